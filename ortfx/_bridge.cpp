// ortfx._bridge: the two C++ functions ONNX Runtime calls to run a PythonOp / PythonOpGrad node.
//
// ORT's training layer takes the address of a runner (register_forward_runner /
// register_backward_runner) and calls it, without the GIL, with std::vector arguments. Each
// runner here only takes the GIL, packs its arguments into Python objects and calls the Python
// function ortfx registered (ortfx.runtime.pythonop); all torch work happens there. Only Python.h
// is used (limited API, abi3), so the extension builds in about a second and does not depend on
// torch's C++ ABI.
//
// Reference rules (ORT 1.19): `args` are borrowed; the returned vector holds new references
// (ORT steals them). The Python function returns a list; its items are increfed here and the
// list dropped, so a capsule the list held alone reaches ORT with a reference count of 1.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

PyObject* forward_target = nullptr;   // strong references, dropped by clear()
PyObject* backward_target = nullptr;

// Py_BuildValue "O&" converters take a void*.
PyObject* int_list(void* pointer) {
  const auto& values = *static_cast<const std::vector<int64_t>*>(pointer);
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), item);  // steals item
  }
  return list;
}

PyObject* object_tuple(void* pointer) {
  const auto& values = *static_cast<const std::vector<PyObject*>*>(pointer);
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = values[i] != nullptr ? values[i] : Py_None;
    Py_INCREF(item);
    PyTuple_SetItem(tuple, static_cast<Py_ssize_t>(i), item);  // steals the new reference
  }
  return tuple;
}

// The pending Python error as text, cleared; the Python side keeps the exception object itself.
std::string take_error_text() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  std::string text = "ortfx PythonOp: the Python runner raised";
  PyObject* shown = value != nullptr ? PyObject_Str(value) : nullptr;
  if (shown != nullptr) {
    const char* utf8 = PyUnicode_AsUTF8AndSize(shown, nullptr);
    if (utf8 != nullptr) text += std::string(": ") + utf8;
    Py_DECREF(shown);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return text;
}

class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

std::vector<PyObject*> run(PyObject** target, const char* func_name, void* callback,
                           const std::vector<int64_t>& requires_grad,
                           const std::vector<int64_t>& tensor_flags, bool is_training,
                           const std::vector<int64_t>& inplace_map, const char* invoke_id,
                           bool safe_run, const std::vector<PyObject*>& args) {
  Gil gil;
  if (*target == nullptr) {
    throw std::runtime_error(
        "ortfx PythonOp: no Python runner is registered (ortfx tore the bridge down at exit)");
  }
  PyObject* function = *target;
  Py_INCREF(function);  // clear() may run from inside the call
  PyObject* call_args = Py_BuildValue(
      "(sOO&O&NO&sNO&)", func_name,
      callback != nullptr ? static_cast<PyObject*>(callback) : Py_None,
      int_list, const_cast<std::vector<int64_t>*>(&requires_grad), int_list,
      const_cast<std::vector<int64_t>*>(&tensor_flags), PyBool_FromLong(is_training), int_list,
      const_cast<std::vector<int64_t>*>(&inplace_map), invoke_id, PyBool_FromLong(safe_run),
      object_tuple, const_cast<std::vector<PyObject*>*>(&args));
  PyObject* result = call_args != nullptr ? PyObject_CallObject(function, call_args) : nullptr;
  Py_XDECREF(call_args);
  Py_DECREF(function);
  if (result == nullptr) throw std::runtime_error(take_error_text());
  if (!PyList_Check(result)) {
    Py_DECREF(result);
    throw std::runtime_error("ortfx PythonOp: the Python runner must return a list");
  }
  Py_ssize_t n = PyList_Size(result);
  std::vector<PyObject*> outputs;
  outputs.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GetItem(result, i);  // borrowed
    Py_INCREF(item);
    outputs.push_back(item);
  }
  Py_DECREF(result);
  return outputs;
}

std::vector<PyObject*> forward_runner(const char* func_name, void* callback,
                                      const std::vector<int64_t>& requires_grad,
                                      const std::vector<int64_t>& tensor_flags, bool is_training,
                                      const std::vector<int64_t>& inplace_map,
                                      const char* invoke_id, bool safe_run,
                                      const std::vector<PyObject*>& args) {
  return run(&forward_target, func_name, callback, requires_grad, tensor_flags, is_training,
             inplace_map, invoke_id, safe_run, args);
}

std::vector<PyObject*> backward_runner(const char* func_name, void* callback,
                                       const std::vector<int64_t>& requires_grad,
                                       const std::vector<int64_t>& tensor_flags, bool is_training,
                                       const std::vector<int64_t>& inplace_map,
                                       const char* invoke_id, bool safe_run,
                                       const std::vector<PyObject*>& args) {
  return run(&backward_target, func_name, callback, requires_grad, tensor_flags, is_training,
             inplace_map, invoke_id, safe_run, args);
}

// The runner type ORT 1.19 expects; the static_casts below fail to compile if ours drift.
using Runner = std::vector<PyObject*> (*)(const char*, void*, const std::vector<int64_t>&,
                                          const std::vector<int64_t>&, bool,
                                          const std::vector<int64_t>&, const char*, bool,
                                          const std::vector<PyObject*>&);

// ---- the ATen executor: ORT's org.pytorch.aten::ATen nodes run a torch op -------------------
//
// ORT takes two plain-C function addresses (register_aten_op_executor) and calls them without
// the GIL. Tensors cross as DLPack: an input pointer is wrapped in a "dltensor" capsule that
// torch.from_dlpack consumes (it then owns it and calls its deleter); an output capsule from
// torch.utils.dlpack.to_dlpack is renamed "used_dltensor" here, so ORT owns the pointer.

PyObject* aten_tensor_target = nullptr;  // (op, overload, index, is_input) -> bool
PyObject* aten_execute_target = nullptr;  // (op, overload, inputs, n_out) -> list

bool aten_is_tensor_argument(const char* op, const char* overload, size_t index, bool is_input) {
  Gil gil;
  if (aten_tensor_target == nullptr) {
    throw std::runtime_error("ortfx ATen: no Python executor is registered");
  }
  PyObject* result = PyObject_CallFunction(aten_tensor_target, "ssnO", op, overload,
                                           static_cast<Py_ssize_t>(index),
                                           is_input ? Py_True : Py_False);
  if (result == nullptr) throw std::runtime_error(take_error_text());
  int truth = PyObject_IsTrue(result);
  Py_DECREF(result);
  if (truth < 0) throw std::runtime_error(take_error_text());
  return truth == 1;
}

void aten_execute(const char* op, const char* overload, size_t n_in, void** inputs, size_t n_out,
                  void** outputs) {
  Gil gil;
  if (aten_execute_target == nullptr) {
    throw std::runtime_error("ortfx ATen: no Python executor is registered");
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n_in));
  if (list == nullptr) throw std::runtime_error(take_error_text());
  for (size_t i = 0; i < n_in; ++i) {
    PyObject* item = inputs[i] != nullptr ? PyCapsule_New(inputs[i], "dltensor", nullptr)
                                          : (Py_INCREF(Py_None), Py_None);
    if (item == nullptr) {
      Py_DECREF(list);
      throw std::runtime_error(take_error_text());
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), item);  // steals item
  }
  PyObject* result = PyObject_CallFunction(aten_execute_target, "ssOn", op, overload, list,
                                           static_cast<Py_ssize_t>(n_out));
  Py_DECREF(list);
  if (result == nullptr) throw std::runtime_error(take_error_text());
  if (!PyList_Check(result) || PyList_Size(result) != static_cast<Py_ssize_t>(n_out)) {
    Py_DECREF(result);
    throw std::runtime_error("ortfx ATen: the Python executor must return one item per output");
  }
  for (size_t i = 0; i < n_out; ++i) {
    PyObject* item = PyList_GetItem(result, static_cast<Py_ssize_t>(i));  // borrowed
    if (item == Py_None) {
      outputs[i] = nullptr;
      continue;
    }
    void* pointer = PyCapsule_GetPointer(item, "dltensor");
    if (pointer == nullptr || PyCapsule_SetName(item, "used_dltensor") != 0) {
      Py_DECREF(result);
      throw std::runtime_error(take_error_text());
    }
    outputs[i] = pointer;
  }
  Py_DECREF(result);
}

// The executor types ORT 1.19 expects (DLManagedTensor** passed as void**).
using IsTensorArgument = bool (*)(const char*, const char*, size_t, bool);
using Execute = void (*)(const char*, const char*, size_t, void**, size_t, void**);

PyObject* set_aten_executor(PyObject*, PyObject* args) {
  PyObject *is_tensor = nullptr, *execute = nullptr;
  if (!PyArg_ParseTuple(args, "OO:set_aten_executor", &is_tensor, &execute)) return nullptr;
  if (!PyCallable_Check(is_tensor) || !PyCallable_Check(execute)) {
    PyErr_SetString(PyExc_TypeError, "set_aten_executor(is_tensor, execute) takes two callables");
    return nullptr;
  }
  Py_INCREF(is_tensor);
  Py_INCREF(execute);
  PyObject* old_is_tensor = aten_tensor_target;
  PyObject* old_execute = aten_execute_target;
  aten_tensor_target = is_tensor;
  aten_execute_target = execute;
  Py_XDECREF(old_is_tensor);
  Py_XDECREF(old_execute);
  Py_RETURN_NONE;
}

PyObject* aten_addresses(PyObject*, PyObject*) {
  return Py_BuildValue(
      "(NN)",
      PyLong_FromVoidPtr(
          reinterpret_cast<void*>(static_cast<IsTensorArgument>(&aten_is_tensor_argument))),
      PyLong_FromVoidPtr(reinterpret_cast<void*>(static_cast<Execute>(&aten_execute))));
}

PyObject* set_runners(PyObject*, PyObject* args) {
  PyObject *forward = nullptr, *backward = nullptr;
  if (!PyArg_ParseTuple(args, "OO:set_runners", &forward, &backward)) return nullptr;
  if (!PyCallable_Check(forward) || !PyCallable_Check(backward)) {
    PyErr_SetString(PyExc_TypeError, "set_runners(forward, backward) takes two callables");
    return nullptr;
  }
  Py_INCREF(forward);
  Py_INCREF(backward);
  PyObject* old_forward = forward_target;
  PyObject* old_backward = backward_target;
  forward_target = forward;
  backward_target = backward;
  Py_XDECREF(old_forward);
  Py_XDECREF(old_backward);
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  Py_CLEAR(forward_target);
  Py_CLEAR(backward_target);
  Py_CLEAR(aten_tensor_target);
  Py_CLEAR(aten_execute_target);
  Py_RETURN_NONE;
}

PyObject* forward_runner_address(PyObject*, PyObject*) {
  return PyLong_FromVoidPtr(reinterpret_cast<void*>(static_cast<Runner>(&forward_runner)));
}

PyObject* backward_runner_address(PyObject*, PyObject*) {
  return PyLong_FromVoidPtr(reinterpret_cast<void*>(static_cast<Runner>(&backward_runner)));
}

PyObject* refcount(PyObject*, PyObject* object) {
  // Py_REFCNT is a function in the limited API; minus the reference this call holds.
  return PyLong_FromSsize_t(Py_REFCNT(object) - 1);
}

PyMethodDef methods[] = {
    {"set_runners", set_runners, METH_VARARGS,
     "set_runners(forward, backward): the Python functions the runners call."},
    {"clear", clear, METH_NOARGS, "Drop the Python functions; later runs raise in ORT."},
    {"forward_runner_address", forward_runner_address, METH_NOARGS,
     "Address of the forward runner, for register_forward_runner."},
    {"backward_runner_address", backward_runner_address, METH_NOARGS,
     "Address of the backward runner, for register_backward_runner."},
    {"refcount", refcount, METH_O, "The reference count of an object, as ORT checks it."},
    {"set_aten_executor", set_aten_executor, METH_VARARGS,
     "set_aten_executor(is_tensor, execute): the Python functions the ATen executor calls."},
    {"aten_addresses", aten_addresses, METH_NOARGS,
     "(is_tensor_argument, execute) addresses, for register_aten_op_executor."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ortfx._bridge",
    "Runners ONNX Runtime calls for PythonOp nodes; they forward to Python.", -1, methods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__bridge(void) { return PyModule_Create(&module); }
