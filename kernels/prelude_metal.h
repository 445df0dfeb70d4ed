// mtplx kernel prelude: Metal (mx.fast.metal_kernel). Passed as `header`.
// The body and common.h are written only against the MTPLX_* names below.
#include <metal_stdlib>
using namespace metal;
typedef ulong mtplx_u64;

#define MTPLX_FN inline
#define MTPLX_TG threadgroup
#define MTPLX_TGP(T) threadgroup T*
#define MTPLX_THP(T) thread T*
#define MTPLX_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define MTPLX_SHFL_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define MTPLX_SHFL_UP(x, d) simd_shuffle_up((x), (ushort)(d))
// Default ("safe") math mode is required: exp(-inf) must be exactly 0.
#define MTPLX_EXP(x) metal::exp(x)
#define MTPLX_LOG(x) metal::log(x)
#define MTPLX_AS_UINT(x) as_type<uint>(x)
#define MTPLX_NEG_INF (-INFINITY)

// The line below is not a comment to the builder: kernels.py prepends its
// text to the kernel `source`. mlx only declares Metal thread-position
// attributes for names that appear in `source`, never in `header`.
// MTPLX-ENTRY: const uint mtplx_lid = thread_position_in_threadgroup.x; const uint mtplx_grp = threadgroup_position_in_grid.x;
