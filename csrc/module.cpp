// The only file that includes Python.h: an empty module named _C, so that `import
// speedtorch_ops._C` loads this library and runs its TORCH_LIBRARY registrations.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
