// A float32 GEMM for XLA:CPU as an FFI custom call, computed by the OpenBLAS that
// numpy ships (scipy-openblas, ILP64). The library is not linked here: Python hands
// over the address of its cblas_sgemm once (ac2_set_sgemm), so nothing but the XLA
// FFI headers is needed to build this file. Issue 41: is XLA:CPU's own GEMM the gap?
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// cblas_sgemm with 64-bit integers (scipy_cblas_sgemm64_).
typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                         float beta, float* c, int64_t ldc);

static sgemm_fn g_sgemm = nullptr;

extern "C" void ac2_set_sgemm(void* fn) { g_sgemm = reinterpret_cast<sgemm_fn>(fn); }

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// c = op(a) @ op(b) for 2-D row-major a, b; op transposes when the flag is set.
static ffi::Error Gemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  if (g_sgemm == nullptr) {
    return ffi::Error::InvalidArgument("ac2_gemm: no sgemm set (call ac2_set_sgemm first)");
  }
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("ac2_gemm: a and b must be 2-D");
  }
  const int64_t m = trans_a ? ad[1] : ad[0], k = trans_a ? ad[0] : ad[1];
  const int64_t kb = trans_b ? bd[1] : bd[0], n = trans_b ? bd[0] : bd[1];
  if (k != kb) {
    return ffi::Error::InvalidArgument("ac2_gemm: inner dimensions differ");
  }
  g_sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, m, n, k, 1.0f,
          a.typed_data(), ad[1], b.typed_data(), bd[1], 0.0f, c->typed_data(), n);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Ac2Gemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
