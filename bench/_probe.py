import faulthandler, sys, torch
faulthandler.enable()
import speedtorch_ops as s
print("loaded", flush=True)
t = torch.randn(20, 4)
for dev in ["cpu", "cuda"]:
    i = torch.tensor([1, 3, 5, 20], device=dev)
    for name, tab in [("cpu", t), ("pinned", s.empty_pinned((20, 4)).copy_(t)), ("cuda", t.cuda())]:
        try:
            print(dev, name, s.pinned_gather(tab, i[:3]).sum().item(), flush=True)
        except Exception as e:
            print(dev, name, "ERR", str(e)[:100], flush=True)
        try:
            s.pinned_gather(tab, i)
        except Exception as e:
            print(dev, name, "ERR", str(e)[:100], flush=True)
