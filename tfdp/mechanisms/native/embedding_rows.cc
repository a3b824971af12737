// An embedding's per-example rows, compiled: the same values, bit for bit, as
// the TensorFlow ops of tfdp/per_example/rules/embedding.py, which stay the
// reference and the fallback (tfdp/per_example/native_rows.py checks the two
// against each other when the library loads).
//
//  * TfdpScatterRows(indices [N], updates [N, D], rows) -> [rows, D]:
//    tf.scatter_nd(indices[:, None], updates, [rows, D]), the clipped sum of
//    an embedding table: zeros, then out[indices[n]] += updates[n] for n = 0,
//    1, ..., N - 1 (TensorFlow's CPU ScatterNd adds in that order).
//  * TfdpFirstPositions(ids [B, L]) -> [B, L]: `first_positions`, for each
//    position the first position in its row holding the same id (integers:
//    one answer, found here by a small hash table a row, its hash salted).
//  * TfdpMergeRows(g [B, L, D], first [B, L]) -> [B, L, D]: `merge_rows`,
//    each example's rows of a repeated id added into the id's first
//    position: out[b, t] = g[b, t] where first[b, t] == t, else 0; then
//    out[b, first[b, t]] += g[b, t] for every other (b, t) in row-major order
//    (the order of tf.where's positions and tensor_scatter_nd_add's adds).
//
// Every entry is the same sequence of IEEE additions as the reference's, in
// the same order: work is split across threads by table rows (the scatter)
// or by examples (the merge), never within one entry's sum. Copies move bits
// (-0.0 and subnormal values stay as they are, as tf.where leaves them). The
// reference adds each row in the thread that runs the op, flushing
// subnormal results to zero or not as that thread does (TensorFlow's
// executor threads flush; an eager caller's thread may not), so on x86-64
// every worker here adds under the calling thread's flush-to-zero and
// denormals-are-zero bits (elsewhere the workers keep their own mode, and
// the self-check at load refuses the ops if that changes a value). An index
// outside its range, or rows of width 0, is an error (TensorFlow's ops
// raise there too), before anything is written.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfdp_rows {

using namespace tensorflow;  // NOLINT: the op framework's names
using std::int64_t;

// This thread's floating-point control word (x86: MXCSR; elsewhere 0).
unsigned ControlWord() {
#if defined(__x86_64__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

// While alive, this thread flushes subnormal results to zero (FTZ) and
// reads subnormal inputs as zero (DAZ) exactly as `caller` does.
class CallersDenormalMode {
 public:
  explicit CallersDenormalMode(unsigned caller) : saved_(ControlWord()) {
#if defined(__x86_64__)
    _mm_setcsr((saved_ & ~kBits) | (caller & kBits));
#endif
  }
  ~CallersDenormalMode() {
#if defined(__x86_64__)
    _mm_setcsr(saved_);
#endif
  }

 private:
  static constexpr unsigned kBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
};

REGISTER_OP("TfdpScatterRows")
    .Input("indices: int32")
    .Input("updates: T")
    .Input("rows: int32")
    .Output("output: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle indices, updates, rows_shape;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &updates));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &rows_shape));
      shape_inference::DimensionHandle rows;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &rows));
      c->set_output(0, c->Matrix(rows, c->Dim(updates, 1)));
      return absl::OkStatus();
    });

template <typename T>
class ScatterRowsOp : public OpKernel {
 public:
  explicit ScatterRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    const Tensor& updates = ctx->input(1);
    const Tensor& rows_in = ctx->input(2);
    OP_REQUIRES(ctx, indices.dims() == 1 && updates.dims() == 2 &&
                         updates.dim_size(0) == indices.dim_size(0) && rows_in.dims() == 0,
                errors::InvalidArgument("TfdpScatterRows takes indices [N], updates [N, D] "
                                        "and a scalar row count; got ",
                                        indices.shape().DebugString(), ", ",
                                        updates.shape().DebugString(), ", ",
                                        rows_in.shape().DebugString()));
    const int64_t rows = rows_in.scalar<int32>()();
    OP_REQUIRES(ctx, rows >= 0, errors::InvalidArgument("negative row count ", rows));
    const int64_t n = indices.dim_size(0), width = updates.dim_size(1);
    OP_REQUIRES(ctx, width > 0, errors::InvalidArgument("TfdpScatterRows takes rows of at "
                                                        "least one entry; got width 0"));
    const int32* index = indices.flat<int32>().data();
    for (int64_t k = 0; k < n; ++k) {
      OP_REQUIRES(ctx, index[k] >= 0 && index[k] < rows,
                  errors::InvalidArgument("indices[", k, "] = [", index[k],
                                          "] does not index into shape [", rows, ",", width,
                                          "]"));
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, width}), &output));
    T* out = output->flat<T>().data();
    const T* in = updates.flat<T>().data();
    const unsigned caller = ControlWord();
    // A thread owns a range of table rows: it zeroes them, then adds every
    // update aimed at one of them, in the order of `indices` (each scans
    // all the indices, a few bytes each, so that no row is shared and each
    // update's row is read and added whole).
    auto table_rows = [&](int64_t first_row, int64_t end_row) {
      CallersDenormalMode mode(caller);
      std::fill(out + first_row * width, out + end_row * width, T(0));
      for (int64_t k = 0; k < n; ++k) {
        const int64_t row = index[k];
        if (row < first_row || row >= end_row) continue;
        T* target = out + row * width;
        const T* source = in + k * width;
        for (int64_t j = 0; j < width; ++j) target[j] += source[j];
      }
    };
    // A row's cost: its zeroing and its share of the updates' additions,
    // plus its share of the index scan.
    const int64_t per_row = std::max<int64_t>(rows, 1);
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    Shard(threads->num_threads, threads->workers, rows, width + (n * width * 2 + n) / per_row,
          table_rows);
  }
};

REGISTER_OP("TfdpFirstPositions")
    .Input("ids: int32")
    .Output("first: int32")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &ids));
      c->set_output(0, ids);
      return absl::OkStatus();
    });

// A strong 64-bit mix (splitmix64's finalizer) of an id and the kernel's
// secret salt: no record can choose ids that collide in the table (a fixed
// hash let one crafted row of colliding ids take quadratic time). The
// result never depends on the hash, only the time does.
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class FirstPositionsOp : public OpKernel {
 public:
  explicit FirstPositionsOp(OpKernelConstruction* ctx)
      : OpKernel(ctx), salt_((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    OP_REQUIRES(ctx, ids.dims() == 2,
                errors::InvalidArgument("TfdpFirstPositions takes ids [B, L]; got ",
                                        ids.shape().DebugString()));
    const int64_t batch = ids.dim_size(0), length = ids.dim_size(1);
    OP_REQUIRES(ctx, length < (int64_t{1} << 30),
                errors::InvalidArgument("rows of ", length, " ids are too long"));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &output));
    int shift = 64;  // the table: 2^(64 - shift) >= 2 L slots, open addressing
    while ((int64_t{1} << (64 - shift)) < 2 * length) --shift;
    const int64_t slots = int64_t{1} << (64 - shift);
    const int32* in = ids.flat<int32>().data();
    int32* out = output->flat<int32>().data();
    auto examples = [&](int64_t begin, int64_t end) {
      std::vector<int32> table(slots);  // a slot holds the first position of its id, or -1
      for (int64_t b = begin; b < end; ++b) {
        const int32* row = in + b * length;
        int32* first = out + b * length;
        std::fill(table.begin(), table.end(), -1);
        for (int64_t t = 0; t < length; ++t) {
          const uint64_t hash = Mix(static_cast<uint64_t>(static_cast<uint32_t>(row[t])) ^ salt_);
          uint64_t slot = shift == 64 ? 0 : hash >> shift;
          while (table[slot] >= 0 && row[table[slot]] != row[t]) slot = (slot + 1) & (slots - 1);
          if (table[slot] < 0) table[slot] = static_cast<int32>(t);
          first[t] = table[slot];
        }
      }
    };
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    Shard(threads->num_threads, threads->workers, batch, length * 20 + slots, examples);
  }

 private:
  const uint64_t salt_;
};

REGISTER_KERNEL_BUILDER(Name("TfdpFirstPositions").Device(DEVICE_CPU), FirstPositionsOp);

REGISTER_OP("TfdpMergeRows")
    .Input("g: T")
    .Input("first: int32")
    .Output("merged: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle g, first;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &g));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &first));
      c->set_output(0, g);
      return absl::OkStatus();
    });

template <typename T>
class MergeRowsOp : public OpKernel {
 public:
  explicit MergeRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& first = ctx->input(1);
    OP_REQUIRES(ctx, g.dims() == 3 && first.dims() == 2 && first.dim_size(0) == g.dim_size(0) &&
                         first.dim_size(1) == g.dim_size(1),
                errors::InvalidArgument("TfdpMergeRows takes g [B, L, D] and first [B, L]; got ",
                                        g.shape().DebugString(), ", ",
                                        first.shape().DebugString()));
    const int64_t batch = g.dim_size(0), length = g.dim_size(1), width = g.dim_size(2);
    OP_REQUIRES(ctx, width > 0, errors::InvalidArgument("TfdpMergeRows takes rows of at least "
                                                        "one entry; got width 0"));
    const int32* position = first.flat<int32>().data();
    for (int64_t k = 0; k < batch * length; ++k) {
      OP_REQUIRES(ctx, position[k] >= 0 && position[k] < length,
                  errors::InvalidArgument("first[", k / length, ", ", k % length, "] = ",
                                          position[k], " is not a position of a row of ",
                                          length));
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, g.shape(), &output));
    T* out = output->flat<T>().data();
    const T* in = g.flat<T>().data();
    const unsigned caller = ControlWord();
    auto examples = [&](int64_t begin, int64_t end) {
      CallersDenormalMode mode(caller);
      for (int64_t b = begin; b < end; ++b) {
        const int32* own = position + b * length;
        T* rows = out + b * length * width;
        const T* grads = in + b * length * width;
        for (int64_t t = 0; t < length; ++t) {
          if (own[t] == t) {
            std::memcpy(rows + t * width, grads + t * width, width * sizeof(T));
          } else {
            std::fill(rows + t * width, rows + (t + 1) * width, T(0));
          }
        }
        for (int64_t t = 0; t < length; ++t) {
          if (own[t] == t) continue;
          T* target = rows + own[t] * width;
          const T* source = grads + t * width;
          for (int64_t j = 0; j < width; ++j) target[j] += source[j];
        }
      }
    };
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    Shard(threads->num_threads, threads->workers, batch, length * width * 3, examples);
  }
};

#define TFDP_REGISTER_ROWS(T)                                                               \
  REGISTER_KERNEL_BUILDER(Name("TfdpScatterRows").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          ScatterRowsOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("TfdpMergeRows").Device(DEVICE_CPU).TypeConstraint<T>("T"),   \
                          MergeRowsOp<T>);
TFDP_REGISTER_ROWS(float)
TFDP_REGISTER_ROWS(double)
#undef TFDP_REGISTER_ROWS

}  // namespace tfdp_rows
