// Accelerator collectives: gather, gather_for_metrics, reduce, broadcast, padding, objects.
#include <torch/torch.h>

#include <algorithm>

#include "accel/accelerator.h"
#include "runtime/accelerator_impl.h"
#include "runtime/comm.h"

namespace accel {
namespace {

torch::Tensor shape_of(const torch::Tensor& t, int64_t dims) {
  auto shape = torch::full({dims + 1}, -1, torch::kLong);
  shape[0] = t.dim();
  for (int64_t d = 0; d < t.dim() && d < dims; ++d) shape[d + 1] = t.size(d);
  return shape;
}

std::string describe(const torch::Tensor& shape_row) {
  std::ostringstream out;
  int64_t dims = shape_row[0].item<int64_t>();
  out << "[";
  for (int64_t d = 0; d < dims; ++d) out << (d ? ", " : "") << shape_row[d + 1].item<int64_t>();
  out << "]";
  return out.str();
}

// `t` grown along `dim` to `size` with `value`, before it (`first`) or after it.
torch::Tensor padded_to(const torch::Tensor& t, int64_t dim, int64_t size, double value,
                        bool first) {
  if (t.size(dim) == size) return t;
  auto shape = t.sizes().vec();
  shape[static_cast<std::size_t>(dim)] = size;
  auto out = torch::full(shape, value, t.options());
  out.narrow(dim, first ? size - t.size(dim) : 0, t.size(dim)).copy_(t);
  return out;
}

}  // namespace

void Accelerator::check_same_shape(const torch::Tensor& tensor, const char* op) {
  // Why: a shape mismatch in gloo is a hang or garbage; in debug mode we pay one more small
  // collective per call to name the ranks instead (HF Accelerate's debug mode does the same).
  constexpr int64_t kMaxDims = 8;
  auto mine = shape_of(tensor, kMaxDims).to(device());
  auto all =
      torch::empty({num_processes() * (kMaxDims + 1)}, torch::dtype(torch::kLong).device(device()));
  state_->comm().allgather(all, mine);
  all = all.view({num_processes(), kMaxDims + 1}).cpu();
  for (int r = 0; r < num_processes(); ++r) {
    if (!torch::equal(all[r], all[0])) {
      throw CollectiveError(
          std::string("accel: ") + op + ": rank 0 has shape " + describe(all[0]) + " but rank " +
          std::to_string(r) + " has " + describe(all[r]) +
          "; every rank must pass the same shape (pad_across_processes pads dim 0)");
    }
  }
}

torch::Tensor Accelerator::gather(const torch::Tensor& tensor) {
  // Why: a 0-dim tensor gathers to [num_processes] on every world size, 1 included, so code
  // written on one process keeps its shapes on N.
  if (!use_distributed()) return tensor.dim() == 0 ? tensor.reshape({1}) : tensor;
  if (state_->debug()) check_same_shape(tensor, "gather");
  auto input = tensor.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  if (sizes.empty())
    sizes.push_back(num_processes());
  else
    sizes[0] *= num_processes();
  auto output = torch::empty(sizes, input.options());
  state_->comm().allgather(output, input);
  return output;
}

std::vector<int64_t> Accelerator::all_sizes(int64_t mine) {
  auto sizes = torch::empty({num_processes()}, torch::dtype(torch::kLong).device(device()));
  state_->comm().allgather(sizes,
                           torch::full({1}, mine, torch::dtype(torch::kLong).device(device())));
  sizes = sizes.cpu();
  return {sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + num_processes()};
}

// One size exchange, a local pad, one gather: two collectives for any sizes along dim 0.
torch::Tensor Accelerator::gather_uneven(const torch::Tensor& tensor,
                                         std::vector<int64_t>* sizes_out) {
  auto input = tensor.dim() == 0 ? tensor.reshape({1}) : tensor.contiguous();
  auto sizes = all_sizes(input.size(0));
  int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  auto all = gather(padded_to(input, 0, largest, 0, false));
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < num_processes(); ++r)
    parts.push_back(all.narrow(0, r * largest, sizes[static_cast<std::size_t>(r)]));
  if (sizes_out != nullptr) *sizes_out = std::move(sizes);
  return torch::cat(parts);
}

torch::Tensor Accelerator::gather_for_metrics(const torch::Tensor& tensor) {
  auto& gs = *gradient_state_;
  torch::Tensor data;
  if (!use_distributed())
    data = tensor;
  else
    data = gs.even_batches() ? gather(tensor) : gather_uneven(tensor);
  if (gs.end_of_dataloader() && gs.remainder() > 0 && data.dim() > 0 &&
      data.size(0) > gs.remainder()) {
    data = data.narrow(0, 0, gs.remainder());
  }
  return data;
}

torch::Tensor Accelerator::reduce(const torch::Tensor& tensor, ReduceOp op) {
  if (!use_distributed()) return tensor.clone();
  c10d::ReduceOp c10d_op = c10d::ReduceOp::SUM;
  if (op == ReduceOp::kMax) c10d_op = c10d::ReduceOp::MAX;
  if (op == ReduceOp::kMin) c10d_op = c10d::ReduceOp::MIN;
  if (state_->debug()) check_same_shape(tensor, "reduce");
  auto out = state_->comm().allreduce_copy(tensor.contiguous(), c10d_op);
  if (op == ReduceOp::kMean) {
    if (out.is_floating_point())
      out.div_(num_processes());
    else
      out = out.to(torch::kDouble).div_(num_processes());
  }
  return out;
}

torch::Tensor Accelerator::broadcast(const torch::Tensor& tensor, int from) {
  if (from < 0 || from >= num_processes()) {
    throw UsageError("accel: broadcast from rank " + std::to_string(from) + " but there are " +
                     std::to_string(num_processes()) + " processes");
  }
  auto out = tensor.contiguous().clone();
  if (!use_distributed()) return out;
  if (state_->debug()) check_same_shape(tensor, "broadcast");
  state_->comm().broadcast(out, from);
  return out;
}

torch::Tensor Accelerator::pad_across_processes(const torch::Tensor& tensor, int64_t dim,
                                                double pad_index, bool pad_first) {
  if (dim < 0) dim += tensor.dim();
  if (!use_distributed() || dim < 0 || dim >= tensor.dim()) return tensor;
  auto sizes = all_sizes(tensor.size(dim));
  int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  return padded_to(tensor, dim, largest, pad_index, pad_first);
}

std::vector<std::string> Accelerator::gather_object(const std::string& object) {
  if (!use_distributed()) return {object};
  auto bytes = torch::from_blob(const_cast<char*>(object.data()),
                                {static_cast<int64_t>(object.size())}, torch::kUInt8);
  std::vector<int64_t> lengths;
  auto all =
      gather_uneven(bytes.to(device(), /*non_blocking=*/false, /*copy=*/true), &lengths).cpu();
  std::vector<std::string> out;
  const char* data = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  int64_t offset = 0;
  for (int r = 0; r < num_processes(); ++r) {
    int64_t n = lengths[static_cast<std::size_t>(r)];
    out.emplace_back(data + offset, static_cast<std::size_t>(n));
    offset += n;
  }
  return out;
}

std::string Accelerator::broadcast_object(const std::string& object, int from) {
  if (!use_distributed()) return object;
  auto length = torch::full({1}, static_cast<int64_t>(object.size()),
                            torch::dtype(torch::kLong).device(device()));
  length = broadcast(length, from);
  int64_t n = length.item<int64_t>();
  auto bytes = torch::zeros({n}, torch::kUInt8);
  if (process_index() == from && n > 0)
    std::memcpy(bytes.data_ptr<uint8_t>(), object.data(), static_cast<std::size_t>(n));
  if (n > 0) {
    bytes = bytes.to(device());
    state_->comm().broadcast(bytes, from);
    bytes = bytes.cpu();
  }
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                     static_cast<std::size_t>(n));
}

void Accelerator::wait_for_everyone() { state_->comm().barrier(); }

bool Accelerator::check_trigger() {
  auto flag =
      torch::full({1}, impl_->trigger_ ? 1 : 0, torch::dtype(torch::kLong).device(device()));
  if (use_distributed()) state_->comm().allreduce(flag, c10d::ReduceOp::SUM);
  bool fired = flag.item<int64_t>() > 0;
  if (fired) impl_->trigger_ = false;
  return fired;
}

std::tuple<std::size_t, std::size_t, std::size_t> Accelerator::split_range(std::size_t n) const {
  auto k = static_cast<std::size_t>(num_processes());
  auto r = static_cast<std::size_t>(process_index());
  std::size_t base = n / k, extra = n % k;
  std::size_t begin = r * base + std::min(r, extra);
  std::size_t end = begin + base + (r < extra ? 1 : 0);
  return {begin, end, base + (extra > 0 ? 1 : 0)};
}

torch::Tensor Accelerator::split_between_processes(const torch::Tensor& items,
                                                   bool apply_padding) const {
  if (items.dim() == 0)
    throw UsageError("accel: split_between_processes needs a tensor with a dim 0");
  auto [begin, end, width] = split_range(static_cast<std::size_t>(items.size(0)));
  auto n = items.size(0);
  torch::Tensor out =
      static_cast<int64_t>(begin) >= n
          ? items.narrow(0, std::max<int64_t>(n - 1, 0), std::min<int64_t>(n, 1))
          : items.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(end - begin));
  if (apply_padding && out.size(0) > 0 && static_cast<std::size_t>(out.size(0)) < width) {
    auto last = items.narrow(0, n - 1, 1);  // HF pads tensors with the last item of all
    std::vector<int64_t> reps(static_cast<std::size_t>(items.dim()), 1);
    reps[0] = static_cast<int64_t>(width) - out.size(0);
    out = torch::cat({out, last.repeat(reps)});
  }
  return out;
}

}  // namespace accel
