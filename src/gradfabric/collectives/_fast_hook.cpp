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
//
// `sum_rows` is `collectives.coo.summed`: a sparse table's rows summed per
// id, the same ids and bits as its reference (`coo.coalesced`: `unique`, then
// `index_add_` into zeros, then a division), in one pass over the rows
// instead of a sort of the ids and several tensor operations (a table's
// gradient is a thousand or so rows, where those cost 40-100 us of fixed
// work a call, twice a table a step, on the hook's thread).

#include <algorithm>
#include <memory>
#include <vector>

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

// The rows of `ids` summed per id into zeros, in the order they come (as
// `index_add_` sums them), then divided by `divisor` (1: not divided); the
// ids ascending. A hash table of the ids seen maps each to its sum's row;
// only the distinct ids are sorted, by an LSD radix sort on their bits below
// `limit` (a comparison sort of a thousand ids costs more than the sums: its
// branches are unpredictable).
template <typename T>
std::pair<at::Tensor, at::Tensor> summed(
    const at::Tensor& ids, const at::Tensor& rows, int64_t limit, int64_t divisor) {
  const int64_t n = ids.size(0), width = rows.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const T* from = rows.data_ptr<T>();
  int64_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  std::vector<int64_t> key(cap);
  std::vector<int32_t> slot(cap, -1);
  std::vector<int64_t> first;  // the distinct ids, in the order they came
  first.reserve(n);
  std::unique_ptr<T[]> sums(new T[std::max<int64_t>(n * width, 1)]);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = static_cast<uint64_t>(id[i]) * 0x9E3779B97F4A7C15ull;
    int64_t at = static_cast<int64_t>(h >> 32) & (cap - 1);
    while (slot[at] >= 0 && key[at] != id[i]) at = (at + 1) & (cap - 1);
    if (slot[at] < 0) {
      key[at] = id[i];
      slot[at] = static_cast<int32_t>(first.size());
      first.push_back(id[i]);
      std::fill_n(sums.get() + slot[at] * width, width, T(0));
    }
    T* into = sums.get() + slot[at] * width;
    const T* row = from + i * width;
    for (int64_t j = 0; j < width; ++j) into[j] += row[j];
  }
  // (id << 32 | its sum's row), sorted by id, 11 bits a pass
  const int64_t u = static_cast<int64_t>(first.size());
  std::vector<uint64_t> order(u), spare(u);
  for (int64_t k = 0; k < u; ++k) order[k] = static_cast<uint64_t>(first[k]) << 32 | k;
  int bits = 0;
  while (bits < 31 && (int64_t{1} << bits) < limit) ++bits;
  for (int shift = 32; shift < 32 + bits; shift += 11) {
    int64_t count[2049] = {0};
    for (uint64_t v : order) ++count[((v >> shift) & 2047) + 1];
    for (int d = 0; d < 2048; ++d) count[d + 1] += count[d];
    for (uint64_t v : order) spare[count[(v >> shift) & 2047]++] = v;
    order.swap(spare);
  }
  at::Tensor out_ids = at::empty({u}, ids.options());
  at::Tensor out_rows = at::empty({u, width}, rows.options());
  int64_t* oid = out_ids.data_ptr<int64_t>();
  T* orow = out_rows.data_ptr<T>();
  const T by = static_cast<T>(divisor);
  for (int64_t k = 0; k < u; ++k) {
    const int64_t s = static_cast<int64_t>(order[k] & 0xFFFFFFFFull);
    oid[k] = first[s];
    const T* sum = sums.get() + s * width;
    T* to = orow + k * width;
    if (divisor == 1) {
      std::copy(sum, sum + width, to);
    } else {
      for (int64_t j = 0; j < width; ++j) to[j] = sum[j] / by;
    }
  }
  return {out_ids, out_rows};
}

py::object sum_rows(const at::Tensor& ids, const at::Tensor& rows, int64_t limit, int64_t divisor) {
  TORCH_CHECK(
      ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
          ids.is_contiguous() && rows.device().is_cpu() && rows.dim() == 2 &&
          rows.is_contiguous() && rows.size(0) == ids.size(0) && divisor >= 1 &&
          limit <= (int64_t{1} << 31) && ids.size(0) < (int64_t{1} << 31),
      "sum_rows: contiguous CPU int64 ids (n) and rows (n, width) of a table of "
      "at most 2**31 rows are needed");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    if (p[i] < 0 || p[i] >= limit) return py::none();
  }
  std::pair<at::Tensor, at::Tensor> out;
  {
    py::gil_scoped_release free;
    if (rows.scalar_type() == at::kFloat) {
      out = summed<float>(ids, rows, limit, divisor);
    } else if (rows.scalar_type() == at::kDouble) {
      out = summed<double>(ids, rows, limit, divisor);
    } else {
      TORCH_CHECK(false, "sum_rows: float32 or float64 rows are needed");
    }
  }
  return py::make_tuple(out.first, out.second);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradfabric's DDP hook with its dense calls in C++ (collectives.fast)";
  m.attr("SOURCE") = GRADFABRIC_SOURCE;  // the digest of this file it was built from
  m.def("install", &install, py::arg("reducer"), py::arg("state"), py::arg("hook"),
        py::arg("group_name"), py::arg("table"));
  m.def("sum_rows", &sum_rows, py::arg("ids"), py::arg("rows"), py::arg("limit"),
        py::arg("divisor"));
}
