"""python -m speedtorch_ops.demo"""

from .cli import main

main()
