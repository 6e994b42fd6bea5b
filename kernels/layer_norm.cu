// Layer normalisation over the last axis: y = (x - mean) * rstd * gamma + beta.
//
// Compiled at run time with NVRTC (cupy.RawModule); no host headers are included.
// x, y, dy, dx: [n, d] row-major; gamma, beta: [d]; mean, rstd: [n] with
// rstd = 1 / sqrt(var + eps) and var the biased (1/d) variance, computed in two passes
// (mean first, then squared deviations) so rows with a large offset or zero variance are exact.
// Row kernels use one block per row (rows are grid-strided); blockDim.x must be a multiple of 32
// and at most 1024.
//
// Kernels (T = float / double, suffix _f32 / _f64):
//   layer_norm_fwd_T(x, gamma, beta, y, mean, rstd, n, d, eps)
//   layer_norm_bwd_T(x, gamma, mean, rstd, dy, dx, n, d)
//       dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat)),  g = dy * gamma,
//       xhat = (x - mean) * rstd.
//   layer_norm_bwd_params_T(x, mean, rstd, dy, dgamma_partial, dbeta_partial, n, d,
//                           rows_per_chunk)
//       column partial sums over chunks of rows: dgamma_partial[c, j] = sum dy * xhat,
//       dbeta_partial[c, j] = sum dy; grid = (ceil(d / blockDim.x), num_chunks). The caller sums
//       the partials over axis 0 (deterministic, no atomics).

__device__ __forceinline__ float dd_rsqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double dd_rsqrt(double v) { return rsqrt(v); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// Block-wide sum; every thread gets the result. `slots` holds at least 32 values.
template <typename T>
__device__ T block_sum(T v, T* slots) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // slots may still be read by a previous reduction
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? slots[lane] : T(0);
        v = warp_sum(v);
        if (lane == 0) slots[0] = v;
    }
    __syncthreads();
    return slots[0];
}

template <typename T>
__device__ void layer_norm_fwd_impl(const T* __restrict__ x, const T* __restrict__ gamma,
                                    const T* __restrict__ beta, T* __restrict__ y,
                                    T* __restrict__ mean_out, T* __restrict__ rstd_out,
                                    long long n, long long d, T eps) {
    __shared__ T slots[32];
    for (long long row = blockIdx.x; row < n; row += gridDim.x) {
        const T* xr = x + row * d;
        T* yr = y + row * d;
        T s = T(0);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) s += xr[j];
        const T mean = block_sum(s, slots) / T(d);
        T q = T(0);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const T c = xr[j] - mean;
            q += c * c;
        }
        const T var = block_sum(q, slots) / T(d);
        const T rstd = dd_rsqrt(var + eps);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            yr[j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
        }
        if (threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
    }
}

template <typename T>
__device__ void layer_norm_bwd_impl(const T* __restrict__ x, const T* __restrict__ gamma,
                                    const T* __restrict__ mean_in, const T* __restrict__ rstd_in,
                                    const T* __restrict__ dy, T* __restrict__ dx, long long n,
                                    long long d) {
    __shared__ T slots[32];
    for (long long row = blockIdx.x; row < n; row += gridDim.x) {
        const T* xr = x + row * d;
        const T* dyr = dy + row * d;
        T* dxr = dx + row * d;
        const T mean = mean_in[row];
        const T rstd = rstd_in[row];
        T sg = T(0);
        T sgx = T(0);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const T g = dyr[j] * gamma[j];
            sg += g;
            sgx += g * ((xr[j] - mean) * rstd);
        }
        const T mg = block_sum(sg, slots) / T(d);
        const T mgx = block_sum(sgx, slots) / T(d);
        for (long long j = threadIdx.x; j < d; j += blockDim.x) {
            const T xhat = (xr[j] - mean) * rstd;
            dxr[j] = rstd * (dyr[j] * gamma[j] - mg - xhat * mgx);
        }
    }
}

template <typename T>
__device__ void layer_norm_bwd_params_impl(const T* __restrict__ x, const T* __restrict__ mean_in,
                                           const T* __restrict__ rstd_in, const T* __restrict__ dy,
                                           T* __restrict__ dgamma_partial,
                                           T* __restrict__ dbeta_partial, long long n, long long d,
                                           long long rows_per_chunk) {
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > n) r1 = n;
    T ag = T(0);
    T ab = T(0);
    for (long long r = r0; r < r1; ++r) {
        const T g = dy[r * d + j];
        ag += g * ((x[r * d + j] - mean_in[r]) * rstd_in[r]);
        ab += g;
    }
    dgamma_partial[chunk * d + j] = ag;
    dbeta_partial[chunk * d + j] = ab;
}

extern "C" __global__ void layer_norm_fwd_f32(const float* x, const float* gamma,
                                              const float* beta, float* y, float* mean,
                                              float* rstd, long long n, long long d, float eps) {
    layer_norm_fwd_impl<float>(x, gamma, beta, y, mean, rstd, n, d, eps);
}
extern "C" __global__ void layer_norm_fwd_f64(const double* x, const double* gamma,
                                              const double* beta, double* y, double* mean,
                                              double* rstd, long long n, long long d,
                                              double eps) {
    layer_norm_fwd_impl<double>(x, gamma, beta, y, mean, rstd, n, d, eps);
}
extern "C" __global__ void layer_norm_bwd_f32(const float* x, const float* gamma,
                                              const float* mean, const float* rstd,
                                              const float* dy, float* dx, long long n,
                                              long long d) {
    layer_norm_bwd_impl<float>(x, gamma, mean, rstd, dy, dx, n, d);
}
extern "C" __global__ void layer_norm_bwd_f64(const double* x, const double* gamma,
                                              const double* mean, const double* rstd,
                                              const double* dy, double* dx, long long n,
                                              long long d) {
    layer_norm_bwd_impl<double>(x, gamma, mean, rstd, dy, dx, n, d);
}
extern "C" __global__ void layer_norm_bwd_params_f32(const float* x, const float* mean,
                                                     const float* rstd, const float* dy,
                                                     float* dgamma_partial, float* dbeta_partial,
                                                     long long n, long long d,
                                                     long long rows_per_chunk) {
    layer_norm_bwd_params_impl<float>(x, mean, rstd, dy, dgamma_partial, dbeta_partial, n, d,
                                      rows_per_chunk);
}
extern "C" __global__ void layer_norm_bwd_params_f64(const double* x, const double* mean,
                                                     const double* rstd, const double* dy,
                                                     double* dgamma_partial,
                                                     double* dbeta_partial, long long n,
                                                     long long d, long long rows_per_chunk) {
    layer_norm_bwd_params_impl<double>(x, mean, rstd, dy, dgamma_partial, dbeta_partial, n, d,
                                       rows_per_chunk);
}
