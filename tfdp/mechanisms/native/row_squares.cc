// A row's float32 sum of squares, compiled: the same values, bit for bit,
// as `halving_sum_of_squares` in tfdp/per_example/native_squares.py, which
// stays the reference and the fallback (that module checks the two against
// each other when the library loads).
//
//  * TfdpRowSquares(rows [..., C]) -> [...]: for each row x of C >= 1
//    float32 entries, s_j = x_j * x_j (C roundings), then pairwise sums in
//    a fixed order: with P the least power of two >= C and w = C, for
//    h = P/2, P/4, ..., 1: s_j = s_j + s_{j+h} for j < w - h, then w = h;
//    the result is s_0. (Entries from w - h to h keep their value: the
//    reference adds nothing to them, as a zero padding to P would add +0,
//    which leaves every square, +0 included, as it is.)
//
// Every row is the same sequence of IEEE multiplications and additions as
// the reference's, in the same order, no multiply-add contracted (the
// library is built with -ffp-contract=off); threads split the rows, never
// one row's sum, each worker under the calling thread's handling of
// subnormal numbers (denormal_mode.h). Rows of width 0 are an error.

#include <algorithm>
#include <cstdint>
#include <vector>
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "denormal_mode.h"

namespace tfdp_squares {

using namespace tensorflow;  // NOLINT: the op framework's names
using std::int64_t;

using tfdp_native::CallersDenormalMode;
using tfdp_native::ControlWord;

REGISTER_OP("TfdpRowSquares")
    .Input("rows: float")
    .Output("squares: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle rows, squares;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &rows));
      TF_RETURN_IF_ERROR(c->Subshape(rows, 0, -1, &squares));
      c->set_output(0, squares);
      return absl::OkStatus();
    });

class RowSquaresOp : public OpKernel {
 public:
  explicit RowSquaresOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    OP_REQUIRES(ctx, rows.dims() >= 1,
                errors::InvalidArgument("TfdpRowSquares takes rows [..., C]; got ",
                                        rows.shape().DebugString()));
    const int64_t width = rows.dim_size(rows.dims() - 1);
    OP_REQUIRES(ctx, width > 0, errors::InvalidArgument("TfdpRowSquares takes rows of at "
                                                        "least one entry; got width 0"));
    TensorShape shape = rows.shape();
    shape.RemoveLastDims(1);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &output));
    const int64_t count = shape.num_elements();
    int64_t padded = 1;
    while (padded < width) padded *= 2;
    const float* in = rows.flat<float>().data();
    float* out = output->flat<float>().data();
    const unsigned caller = ControlWord();
    auto some_rows = [&](int64_t begin, int64_t end) {
      CallersDenormalMode mode(caller);
      std::vector<float> buffer(padded);
      float* s = buffer.data();
      for (int64_t r = begin; r < end; ++r) {
        const float* x = in + r * width;
        for (int64_t j = 0; j < width; ++j) s[j] = x[j] * x[j];
        int64_t w = width;
        for (int64_t h = padded / 2; h >= 1; h /= 2) {
          for (int64_t j = 0; j < w - h; ++j) s[j] = s[j] + s[j + h];
          w = h;
        }
        out[r] = s[0];
      }
    };
    const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    Shard(threads->num_threads, threads->workers, count, width * 3, some_rows);
  }
};

REGISTER_KERNEL_BUILDER(Name("TfdpRowSquares").Device(DEVICE_CPU), RowSquaresOp);

}  // namespace tfdp_squares
