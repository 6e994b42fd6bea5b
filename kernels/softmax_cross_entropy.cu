// Softmax cross-entropy with integer labels: loss = mean_i (logsumexp(logits[i]) - logits[i, y_i]).
//
// Compiled at run time with NVRTC (cupy.RawModule); no host headers are included.
// logits: [n, V] row-major, labels: [n] int64. One block per row (rows are grid-strided, so any
// grid size works); blockDim.x must be a multiple of 32 and at most 1024. Row max and
// sum-of-exponentials are block reductions (warp shuffles + 32 shared slots). Everything is
// computed relative to the row max, so logits of any magnitude are safe.
//
// Kernels (T = float / double, suffix _f32 / _f64):
//   softmax_xent_fwd_T(logits, labels, row_loss, row_max, row_lse, n, V)
//       row_loss[i] = row_lse[i] - (logits[i, y_i] - row_max[i]),
//       row_lse[i] = log(sum_j exp(logits[i, j] - row_max[i])). The caller takes the mean of
//       row_loss. An out-of-range label gives a NaN row loss.
//   softmax_xent_bwd_T(logits, labels, row_max, row_lse, ct, dlogits, n, V)
//       dlogits[i, j] = (softmax(logits[i])_j - [j == y_i]) * ct[0] / n; ct is a device scalar.

__device__ __forceinline__ float dd_exp(float v) { return expf(v); }
__device__ __forceinline__ double dd_exp(double v) { return exp(v); }
__device__ __forceinline__ float dd_log(float v) { return logf(v); }
__device__ __forceinline__ double dd_log(double v) { return log(v); }

template <typename T> __device__ __forceinline__ T dd_neg_inf();
template <> __device__ __forceinline__ float dd_neg_inf<float>() {
    return __int_as_float(0xff800000);
}
template <> __device__ __forceinline__ double dd_neg_inf<double>() {
    return __longlong_as_double((long long)0xfff0000000000000ULL);
}
template <typename T> __device__ __forceinline__ T dd_nan();
template <> __device__ __forceinline__ float dd_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double dd_nan<double>() {
    return __longlong_as_double((long long)0x7ff8000000000000ULL);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
    for (int off = 16; off > 0; off >>= 1) {
        const T o = __shfl_down_sync(0xffffffffu, v, off);
        v = o > v ? o : v;
    }
    return v;
}

// Block-wide sum / max; every thread gets the result. `slots` holds at least 32 values.
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
__device__ T block_max(T v, T* slots) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? slots[lane] : dd_neg_inf<T>();
        v = warp_max(v);
        if (lane == 0) slots[0] = v;
    }
    __syncthreads();
    return slots[0];
}

template <typename T>
__device__ void softmax_xent_fwd_impl(const T* __restrict__ logits,
                                      const long long* __restrict__ labels,
                                      T* __restrict__ row_loss, T* __restrict__ row_max,
                                      T* __restrict__ row_lse, long long n, long long V) {
    __shared__ T slots[32];
    for (long long row = blockIdx.x; row < n; row += gridDim.x) {
        const T* lr = logits + row * V;
        T m = dd_neg_inf<T>();
        for (long long j = threadIdx.x; j < V; j += blockDim.x) {
            const T v = lr[j];
            m = v > m ? v : m;
        }
        m = block_max(m, slots);
        T s = T(0);
        for (long long j = threadIdx.x; j < V; j += blockDim.x) s += dd_exp(lr[j] - m);
        s = block_sum(s, slots);
        if (threadIdx.x == 0) {
            const T lse = dd_log(s);
            const long long y = labels[row];
            row_loss[row] = (y >= 0 && y < V) ? lse - (lr[y] - m) : dd_nan<T>();
            row_max[row] = m;
            row_lse[row] = lse;
        }
    }
}

template <typename T>
__device__ void softmax_xent_bwd_impl(const T* __restrict__ logits,
                                      const long long* __restrict__ labels,
                                      const T* __restrict__ row_max, const T* __restrict__ row_lse,
                                      const T* __restrict__ ct, T* __restrict__ dlogits,
                                      long long n, long long V) {
    const T scale = ct[0] / T(n);
    for (long long row = blockIdx.x; row < n; row += gridDim.x) {
        const T* lr = logits + row * V;
        T* dr = dlogits + row * V;
        const T m = row_max[row];
        const T lse = row_lse[row];
        const long long y = labels[row];
        for (long long j = threadIdx.x; j < V; j += blockDim.x) {
            T p = dd_exp((lr[j] - m) - lse);
            if (j == y) p -= T(1);
            dr[j] = p * scale;
        }
    }
}

extern "C" __global__ void softmax_xent_fwd_f32(const float* logits, const long long* labels,
                                                float* row_loss, float* row_max, float* row_lse,
                                                long long n, long long V) {
    softmax_xent_fwd_impl<float>(logits, labels, row_loss, row_max, row_lse, n, V);
}
extern "C" __global__ void softmax_xent_fwd_f64(const double* logits, const long long* labels,
                                                double* row_loss, double* row_max,
                                                double* row_lse, long long n, long long V) {
    softmax_xent_fwd_impl<double>(logits, labels, row_loss, row_max, row_lse, n, V);
}
extern "C" __global__ void softmax_xent_bwd_f32(const float* logits, const long long* labels,
                                                const float* row_max, const float* row_lse,
                                                const float* ct, float* dlogits, long long n,
                                                long long V) {
    softmax_xent_bwd_impl<float>(logits, labels, row_max, row_lse, ct, dlogits, n, V);
}
extern "C" __global__ void softmax_xent_bwd_f64(const double* logits, const long long* labels,
                                                const double* row_max, const double* row_lse,
                                                const double* ct, double* dlogits, long long n,
                                                long long V) {
    softmax_xent_bwd_impl<double>(logits, labels, row_max, row_lse, ct, dlogits, n, V);
}
