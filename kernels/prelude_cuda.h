// mtplx kernel prelude: CUDA (mx.fast.cuda_kernel). Passed as `header`.
// mlx places the header before its own namespace, so these are global.
// Template arguments arrive as constexpr locals (TG), which is why helpers
// take TG as a template parameter instead of reading a global.
typedef unsigned int uint;
typedef unsigned long long mtplx_u64;

#define MTPLX_FN __device__ __forceinline__
#define MTPLX_TG __shared__
#define MTPLX_TGP(T) T*
#define MTPLX_THP(T) T*
#define MTPLX_BARRIER() __syncthreads()
#define MTPLX_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define MTPLX_SHFL_UP(x, d) __shfl_up_sync(0xffffffffu, (x), (d))
// expf/logf, not __expf: mlx compiles without fast math, keep IEEE specials.
#define MTPLX_EXP(x) expf(x)
#define MTPLX_LOG(x) logf(x)
#define MTPLX_AS_UINT(x) __float_as_uint(x)
#define MTPLX_NEG_INF __int_as_float(0xff800000)

// kernels.py prepends the text after the marker to the kernel `source`.
// MTPLX-ENTRY: const uint mtplx_lid = threadIdx.x; const uint mtplx_grp = blockIdx.x;
