// The dense calls of a gradfabric DDP hook, without entering Python.
//
// A Python communication hook costs every bucket a GIL round trip, a Python
// call and a Python `then` callback; on a host-bound rank that is about 5% of
// a dense model's iteration (PyTorch's own `allreduce_hook` included), while
// a C++ hook costs nothing measurable. gradfabric's hooks decide on the host
// only when they scan a bucket; a bucket whose scan went dense skips the next
// scans (`DenseSkip`), and those calls need no decision at all. This hook
// runs them here, exactly as the Python side would (divide by the world
// size, then an asynchronous all-reduce on the default group, as PyTorch's
// built-in ALLREDUCE hook does), and hands every other call to the Python
// hook unchanged.
//
// The table is an int64 CPU tensor shared with Python, one row per bucket
// index: [skips left, calls run here, ring bytes sent by those calls]. Python
// writes column 0 after a scan (when no call of that bucket can be running:
// the bucket's next call comes in the next backward); this hook decrements it
// and adds to columns 1 and 2, which Python only reads (`DenseSkip.fold`).

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#ifndef GRADFABRIC_SOURCE
#define GRADFABRIC_SOURCE "unknown"
#endif

namespace {

class SkipDenseHook : public c10d::CommHookInterface {
 public:
  SkipDenseHook(
      py::object state,
      py::object hook,
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      at::Tensor table)
      : python_(std::move(state), std::move(hook)),
        group_(std::move(group)),
        table_(std::move(table)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const auto key = static_cast<int64_t>(bucket.getIndex());
    int64_t* row = key < table_.size(0) ? table_.data_ptr<int64_t>() + 3 * key : nullptr;
    // a sparse table's bucket is always Python's (``auto_hook`` groups a
    // step's tables; DDP renumbers its buckets after the first step, so a
    // row written for a dense bucket may name a table's bucket later)
    if (row == nullptr || row[0] <= 0 || bucket.getBufferRef().is_sparse()) {
      return python_.runHook(bucket);  // acquires the GIL itself
    }
    row[0] -= 1;
    at::Tensor& buf = bucket.getBufferRef();
    const int64_t world = group_->getSize();
    row[1] += 1;
    row[2] += 2 * (world - 1) * buf.numel() * buf.element_size() / world;
    std::vector<at::Tensor> tensors{buf};
    tensors[0].div_(world);  // before the sum, as the Python side and PyTorch's hook do
    return group_->allreduce(tensors)->getFuture();
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {
      return python_.parseHookResult(result);
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10d::PythonCommHook python_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Tensor table_;
};

void install(
    c10d::Reducer& reducer,
    py::object state,
    py::object hook,
    const std::string& group_name,
    at::Tensor table) {
  TORCH_CHECK(
      table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 &&
          table.size(1) == 3 && table.is_contiguous(),
      "the skip table must be a contiguous int64 CPU tensor of shape (buckets, 3)");
  reducer.register_comm_hook(std::make_unique<SkipDenseHook>(
      std::move(state), std::move(hook), c10d::resolve_process_group(group_name), table));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradfabric's DDP hook with its dense calls in C++ (collectives.fast)";
  m.attr("SOURCE") = GRADFABRIC_SOURCE;  // the digest of this file it was built from
  m.def("install", &install, py::arg("reducer"), py::arg("state"), py::arg("hook"),
        py::arg("group_name"), py::arg("table"));
}
