// Causal attention with head_dim 16 on x86 CPUs with AMX: bfloat16 tile matmuls, float32 softmax in AVX-512.
//
// Built at run time by amx_attention.py (g++, no PyTorch headers) and called through ctypes. Scores live in
// the transposed layout S^T (rows keys, 16 lanes of queries), so per-query softmax statistics are lane-wise
// vector operations rather than horizontal reductions. Matmuls contracting over head_dim use 16-wide tiles;
// those contracting over keys or queries use 32-wide ones (the full AMX depth). Parallel over heads.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

namespace {

constexpr int D = 16;    // head_dim: one tile row of bfloat16 pairs
constexpr int BLK = 16;  // queries or keys per tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr int KEYS_PER_STEP = 64;     // forward: key tiles per online-softmax update
constexpr int QUERIES_PER_STEP = 32;  // backward: query tiles per step
typedef uint16_t bf16;

struct Strides {  // in elements; the head_dim stride is 1
  long batch, head, token;
};

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0-5: 16 rows of 64 bytes (float32 16 x 16 accumulators, or bfloat16 operands contracting over 32 indices);
// tmm6: 16 x 16 bfloat16 left operand and tmm7: 8 rows of 16 bfloat16 pairs, contracting over head_dim.
void configure_tiles() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[6] = 16;
  cfg.colsb[6] = 32;
  cfg.rows[7] = 8;
  cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));  // keeps results normal; exp2(-126) is noise next to 1
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x), in [0, 1)
  // 2^f to 7.5e-5 relative error (a least-squares fit weighted towards minimax), a fiftieth of bfloat16's
  // rounding, which P and dS go through before their matmuls anyway.
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0780228584f), f, _mm512_set1_ps(0.226067188f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.695834825f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999924933f));
  return _mm512_scalef_ps(p, x);  // p * 2^floor(x)
}

inline __m512 load_bf16(const bf16* src) {
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

inline void store_bf16(bf16* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}

// 32 bfloat16: a's 16 values, then b's.
inline void store_bf16x2(bf16* dst, __m512 a, __m512 b) {
  _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Rows a (index 2p) and b (index 2p+1) as 16 interleaved pairs (a[n], b[n]).
inline void store_pair(bf16* dst, __m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_store_si512(dst, _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
}

inline __m512i lane_offsets(long step) {  // lane n: n * step
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32((int)step));
}

// The (dims 2r, 2r+1) pair of 16 consecutive tokens, one 32-bit lane per token.
inline __m512i gather_dim_pair(const bf16* x, __m512i token_offsets, int r) {
  return _mm512_i32gather_epi32(token_offsets, reinterpret_cast<const int*>(x) + r, 4);
}

// x (rows x 16, row stride st) as 16-token blocks of 8 rows of (token n: dims 2r, 2r+1) pairs; zero past rows.
void pack_dim_pairs(const bf16* x, long st, bf16* out, int rows, int blocks) {
  const __m512i offsets = lane_offsets(st / 2);
  memset(out + rows * D, 0, sizeof(bf16) * (blocks * 256 - rows * D));
  for (int b = 0; b < rows / BLK; ++b)
    for (int r = 0; r < D / 2; ++r)
      _mm512_storeu_si512(out + b * 256 + r * 32, gather_dim_pair(x + b * BLK * st, offsets, r));
}

// Consecutive tokens of x paired: out[p][d] = (x[2p][d], x[2p+1][d]); zero past rows, up to `pairs`.
void pack_token_pairs(const bf16* x, long st, bf16* out, int rows, int pairs) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  memset(out + rows / 2 * 32, 0, sizeof(bf16) * (pairs - rows / 2) * 32);
  for (int p = 0; p < rows / 2; ++p) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * p * st));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (2 * p + 1) * st));
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    _mm512_storeu_si512(out + p * 32, _mm512_permutexvar_epi16(idx, ab));
  }
}

// out (16 x cols) = x^T, zero past rows.
void transpose_into(const bf16* x, long st, bf16* out, int rows, int cols) {
  const __m512i offsets = lane_offsets(st / 2);
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                                         22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);  // evens, then odds
  if (cols > rows)
    for (int d = 0; d < D; ++d) memset(out + d * cols + rows, 0, sizeof(bf16) * (cols - rows));
  for (int b = 0; b < rows / BLK; ++b)
    for (int r = 0; r < D / 2; ++r) {
      const __m512i dims = _mm512_permutexvar_epi16(split, gather_dim_pair(x + b * BLK * st, offsets, r));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * r * cols + b * BLK), _mm512_castsi512_si256(dims));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * r + 1) * cols + b * BLK),
                          _mm512_extracti64x4_epi64(dims, 1));
    }
}

// x (rows x 16, row stride st) into a dense buffer, so tile loads read whole cache lines.
void copy_rows(const bf16* x, long st, bf16* out, int rows) {
  for (int t = 0; t < rows; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * D),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * st)));
}

inline __mmask16 causal_mask(int r) { return (__mmask16)(0xFFFFu << r); }  // queries n >= key r

// Tiles A and B = the 16 rows at ``rows`` (stride ``stride`` elements) times the two 16-query tiles that
// follow each other at ``dims``; tile registers 6 and 7 hold the operands. A macro: the tile intrinsics
// paste their register numbers into the assembly, so they must be literals.
#define ROWS_TIMES_TWO_QUERY_TILES(A, B, rows, stride, dims) \
  do {                                                       \
    _tile_loadd(6, (rows), (stride) * 2);                    \
    _tile_zero(A);                                           \
    _tile_loadd(7, (dims), 64);                              \
    _tile_dpbf16ps(A, 6, 7);                                 \
    _tile_zero(B);                                           \
    _tile_loadd(7, (dims) + 256, 64);                        \
    _tile_dpbf16ps(B, 6, 7);                                 \
  } while (0)

struct Workspace {
  std::vector<bf16> q_dims, do_dims, q_tokens, do_tokens, kv_t, k_rows, v_rows;
  std::vector<float> dq_t, dk, dv, lse2, delta;
  alignas(64) float s[4 * 256], dp[2 * 256];
  alignas(64) bf16 pt[512], dst[512], pairs[1024];
  explicit Workspace(int T)
      : q_dims((T + QUERIES_PER_STEP) * D), do_dims((T + QUERIES_PER_STEP) * D),
        q_tokens((T + QUERIES_PER_STEP) * D), do_tokens((T + QUERIES_PER_STEP) * D),
        kv_t((T + KEYS_PER_STEP) * D), k_rows(T * D), v_rows(T * D), dq_t((T + QUERIES_PER_STEP) * D),
        dk(T * D), dv(T * D), lse2(T + QUERIES_PER_STEP), delta(T + QUERIES_PER_STEP) {}
};

// One (batch, head): o and the natural-log lse (T) from q, k, v (T x 16 each, row strides qs, ks, vs, os).
void forward_head(const bf16* q, long qs, const bf16* k, long ks, const bf16* v, long vs, bf16* o, long os,
                  float* lse, int T, float scale, Workspace& w) {
  const int nb = T / BLK, cols = T + KEYS_PER_STEP;
  const __m512 c = _mm512_set1_ps(scale * LOG2E);
  pack_dim_pairs(q, qs, w.q_dims.data(), T, nb);
  transpose_into(v, vs, w.kv_t.data(), T, cols);
  copy_rows(k, ks, w.k_rows.data(), T);
  k = w.k_rows.data();
  ks = D;
  for (int i = 0; i < nb; ++i) {
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();  // running max (log2 units) and sum
    __m512 o_t[D];                                                    // O^T: rows head dims, lanes queries
    for (int d = 0; d < D; ++d) o_t[d] = _mm512_setzero_ps();
    _tile_loadd(7, w.q_dims.data() + i * 256, 64);
    for (int j0 = 0; j0 <= i; j0 += 4) {
      const int nt = i + 1 - j0 < 4 ? i + 1 - j0 : 4;  // key tiles in this step; the diagonal one is last
      const bf16* kj = k + j0 * BLK * ks;
      // S^T, one 16 x 16 tile per 16 keys: rows keys, lanes queries.
      _tile_zero(0);
      _tile_loadd(6, kj, ks * 2);
      _tile_dpbf16ps(0, 6, 7);
      _tile_stored(0, w.s, 64);
      if (nt > 1) {
        _tile_zero(1);
        _tile_loadd(6, kj + BLK * ks, ks * 2);
        _tile_dpbf16ps(1, 6, 7);
        _tile_stored(1, w.s + 256, 64);
      }
      if (nt > 2) {
        _tile_zero(2);
        _tile_loadd(6, kj + 2 * BLK * ks, ks * 2);
        _tile_dpbf16ps(2, 6, 7);
        _tile_stored(2, w.s + 512, 64);
      }
      if (nt > 3) {
        _tile_zero(3);
        _tile_loadd(6, kj + 3 * BLK * ks, ks * 2);
        _tile_dpbf16ps(3, 6, 7);
        _tile_stored(3, w.s + 768, 64);
      }
      const int rows = nt * BLK, diag = j0 + nt - 1 == i ? rows - BLK : rows;  // first row of the diagonal tile
      __m512 smax = _mm512_set1_ps(-INFINITY);
      for (int r = 0; r < rows; ++r) {
        __m512 x = _mm512_load_ps(w.s + r * 16);
        if (r >= diag) x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), causal_mask(r - diag), x);
        smax = _mm512_max_ps(smax, x);
      }
      const __m512 mnew = _mm512_max_ps(m, _mm512_mul_ps(smax, c));
      const __m512 alpha = exp2_ps(_mm512_sub_ps(m, mnew));
      l = _mm512_mul_ps(l, alpha);
      for (int r = 0; r < rows; r += 2) {
        __m512 p0 = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w.s + r * 16), c, mnew));
        __m512 p1 = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w.s + (r + 1) * 16), c, mnew));
        if (r >= diag) {
          p0 = _mm512_maskz_mov_ps(causal_mask(r - diag), p0);
          p1 = _mm512_maskz_mov_ps(causal_mask(r + 1 - diag), p1);
        }
        l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
        store_pair(w.pairs + r * 16, p0, p1);
      }
      if (nt % 2) memset(w.pairs + rows * 16, 0, sizeof(bf16) * BLK * 16);  // the odd tile's missing partner
      // O^T (16 x 16) += V^T (16 x 32 keys) P^T (32 keys x 16), per 32 keys.
      _tile_zero(4);
      _tile_loadd(0, w.kv_t.data() + j0 * BLK, cols * 2);
      _tile_loadd(1, w.pairs, 64);
      _tile_dpbf16ps(4, 0, 1);
      if (nt > 2) {
        _tile_loadd(2, w.kv_t.data() + j0 * BLK + 32, cols * 2);
        _tile_loadd(3, w.pairs + 512, 64);
        _tile_dpbf16ps(4, 2, 3);
      }
      _tile_stored(4, w.s, 64);
      for (int d = 0; d < D; ++d) o_t[d] = _mm512_fmadd_ps(o_t[d], alpha, _mm512_load_ps(w.s + d * 16));
      m = mnew;
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    alignas(64) float acc[D * 16], mm[16], ll[16];
    for (int d = 0; d < D; ++d) _mm512_store_ps(acc + d * 16, _mm512_mul_ps(o_t[d], inv));
    const __m512i dims = lane_offsets(16);
    for (int n = 0; n < BLK; ++n) store_bf16(o + (i * BLK + n) * os, _mm512_i32gather_ps(dims, acc + n, 4));
    _mm512_store_ps(mm, m);
    _mm512_store_ps(ll, l);
    for (int n = 0; n < BLK; ++n) lse[i * BLK + n] = mm[n] / LOG2E + logf(ll[n]);
  }
}

// One (batch, query head) against its group's K, V, K^T already packed in w: dq (bfloat16), and adds this
// head's float32 dK/scale and dV into w.dk and w.dv.
void backward_head(const bf16* q, long qs, const bf16* o, long os, const bf16* dout, long dos, const float* lse,
                   bf16* dq, long dqs, int T, float scale, Workspace& w) {
  const int nb = T / BLK, cols = T + QUERIES_PER_STEP;
  const __m512 c = _mm512_set1_ps(scale * LOG2E);
  pack_dim_pairs(q, qs, w.q_dims.data(), T, cols / BLK);
  pack_dim_pairs(dout, dos, w.do_dims.data(), T, cols / BLK);
  pack_token_pairs(q, qs, w.q_tokens.data(), T, cols / 2);
  pack_token_pairs(dout, dos, w.do_tokens.data(), T, cols / 2);
  const bf16* k = w.k_rows.data();  // the group's K, V and K^T, packed once by the caller
  const bf16* v = w.v_rows.data();
  const long ks = D, vs = D;
  float* dq_t = w.dq_t.data();  // dQ^T (16 x cols)
  memset(dq_t, 0, sizeof(float) * cols * D);
  for (int t = 0; t < cols; ++t) {
    if (t < T) {
      // delta = rowsum(dO * O), the softmax backward's per-query correction.
      w.delta[t] = _mm512_reduce_add_ps(_mm512_mul_ps(load_bf16(dout + t * dos), load_bf16(o + t * os)));
      w.lse2[t] = lse[t] * LOG2E;
    } else {
      w.delta[t] = w.lse2[t] = 0.f;
    }
  }
  for (int j = 0; j < nb; ++j) {
    _tile_loadd(4, w.dv.data() + j * 256, 64);  // dV_j and dK_j accumulate over the group's query heads
    _tile_loadd(5, w.dk.data() + j * 256, 64);
    const bf16* kj = k + j * BLK * ks;
    const bf16* vj = v + j * BLK * vs;
    for (int i0 = j; i0 < nb; i0 += 2) {
      const bool second = i0 + 1 < nb;  // else the second query tile is padding
      ROWS_TIMES_TWO_QUERY_TILES(0, 1, kj, ks, w.q_dims.data() + i0 * 256);  // S^T
      ROWS_TIMES_TWO_QUERY_TILES(2, 3, vj, vs, w.do_dims.data() + i0 * 256);  // dP^T
      _tile_stored(0, w.s, 64);
      _tile_stored(1, w.s + 256, 64);
      _tile_stored(2, w.dp, 64);
      _tile_stored(3, w.dp + 256, 64);
      const float* lse2 = w.lse2.data() + i0 * BLK;
      const float* delta = w.delta.data() + i0 * BLK;
      const __m512 l2a = _mm512_loadu_ps(lse2), l2b = _mm512_loadu_ps(lse2 + 16);
      const __m512 dla = _mm512_loadu_ps(delta), dlb = _mm512_loadu_ps(delta + 16);
      // dS^T rows r, r+1 as bfloat16 [query tile a | b] -> (row r, row r+1) pairs per query, for each tile.
      const __m512i pairs_a = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i pairs_b = _mm512_add_epi16(pairs_a, _mm512_set1_epi16(16));
      for (int r = 0; r < BLK; r += 2) {
        __m512i ds_rows[2];
        for (int e = 0; e < 2; ++e) {
          const int rr = r + e;
          __m512 pa = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w.s + rr * 16), c, l2a));
          __m512 pb = exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(w.s + 256 + rr * 16), c, l2b));
          if (i0 == j) pa = _mm512_maskz_mov_ps(causal_mask(rr), pa);
          if (!second) pb = _mm512_setzero_ps();
          const __m512 dsa = _mm512_mul_ps(pa, _mm512_sub_ps(_mm512_load_ps(w.dp + rr * 16), dla));
          const __m512 dsb = _mm512_mul_ps(pb, _mm512_sub_ps(_mm512_load_ps(w.dp + 256 + rr * 16), dlb));
          store_bf16x2(w.pt + rr * 32, pa, pb);
          ds_rows[e] = (__m512i)_mm512_cvtne2ps_pbh(dsb, dsa);
          _mm512_store_si512(w.dst + rr * 32, ds_rows[e]);
        }
        _mm512_store_si512(w.pairs + r * 16, _mm512_permutex2var_epi16(ds_rows[0], pairs_a, ds_rows[1]));
        _mm512_store_si512(w.pairs + 256 + r * 16, _mm512_permutex2var_epi16(ds_rows[0], pairs_b, ds_rows[1]));
      }
      _tile_loadd(0, w.pt, 64);
      _tile_loadd(1, w.do_tokens.data() + i0 * 256, 64);
      _tile_dpbf16ps(4, 0, 1);  // dV_j += P^T dO
      _tile_loadd(2, w.dst, 64);
      _tile_loadd(3, w.q_tokens.data() + i0 * 256, 64);
      _tile_dpbf16ps(5, 2, 3);  // dK_j += dS^T Q
      _tile_loadd(6, w.kv_t.data() + j * BLK, T * 2);
      _tile_loadd(0, dq_t + i0 * BLK, cols * 4);
      _tile_loadd(7, w.pairs, 64);
      _tile_dpbf16ps(0, 6, 7);  // dQ^T += K_j^T dS^T
      _tile_stored(0, dq_t + i0 * BLK, cols * 4);
      _tile_loadd(1, dq_t + (i0 + 1) * BLK, cols * 4);
      _tile_loadd(7, w.pairs + 256, 64);
      _tile_dpbf16ps(1, 6, 7);
      _tile_stored(1, dq_t + (i0 + 1) * BLK, cols * 4);
    }
    _tile_stored(4, w.dv.data() + j * 256, 64);
    _tile_stored(5, w.dk.data() + j * 256, 64);
  }
  const __m512i dims = lane_offsets(cols);
  for (int t = 0; t < T; ++t)
    store_bf16(dq + t * dqs, _mm512_mul_ps(_mm512_i32gather_ps(dims, dq_t + t, 4), _mm512_set1_ps(scale)));
}

// Runs fn(unit, workspace) for unit in [0, units) on nthreads threads, each with its own tiles and workspace.
// Returns false if a thread could not be started or a workspace allocated (nothing may throw across the C ABI).
template <typename Fn>
bool parallel_for(int units, int nthreads, int T, Fn fn) {
  std::atomic<int> next(0);
  std::atomic<bool> failed(false);
  auto work = [&]() {
    try {
      configure_tiles();
      Workspace w(T);
      for (int n; (n = next.fetch_add(1)) < units;) fn(n, w);
    } catch (...) {
      failed = true;
      next = units;
    }
    _tile_release();
  };
  std::vector<std::thread> threads;
  try {
    for (int t = 1; t < nthreads; ++t) threads.emplace_back(work);
  } catch (...) {
    failed = true;
  }
  if (!failed) work();
  for (auto& th : threads) th.join();
  return !failed;
}

}  // namespace

extern "C" {

// Linux keeps AMX state off until a process asks for it (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
int amx_attention_enable() { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

// q, o: (B, H, T, 16); k, v: (B, Hkv, T, 16); bfloat16 with the given strides; lse: float32 (B, H, T) contiguous.
// T must be a multiple of 16 and H a multiple of Hkv.
int amx_attention_forward(const bf16* q, const long* qs, const bf16* k, const long* ks, const bf16* v,
                          const long* vs, bf16* o, const long* os, float* lse, int B, int H, int Hkv, int T,
                          float scale, int nthreads) {
  const Strides Q{qs[0], qs[1], qs[2]}, K{ks[0], ks[1], ks[2]}, V{vs[0], vs[1], vs[2]}, O{os[0], os[1], os[2]};
  return parallel_for(B * H, nthreads, T, [&](int n, Workspace& w) {
    const int b = n / H, h = n % H, g = h / (H / Hkv);
    forward_head(q + b * Q.batch + h * Q.head, Q.token, k + b * K.batch + g * K.head, K.token,
                 v + b * V.batch + g * V.head, V.token, o + b * O.batch + h * O.head, O.token,
                 lse + ((long)b * H + h) * T, T, scale, w);
  }) ? 0 : -1;
}

// Gradients of the forward above from dout (like q); dq like q, dk and dv like k (summed over each group).
int amx_attention_backward(const bf16* q, const long* qs, const bf16* k, const long* ks, const bf16* v,
                           const long* vs, const bf16* o, const long* os, const bf16* dout, const long* dos,
                           const float* lse, bf16* dq, const long* dqs, bf16* dk, const long* dks, bf16* dv,
                           const long* dvs, int B, int H, int Hkv, int T, float scale, int nthreads) {
  const Strides Q{qs[0], qs[1], qs[2]}, K{ks[0], ks[1], ks[2]}, V{vs[0], vs[1], vs[2]}, O{os[0], os[1], os[2]},
      DO{dos[0], dos[1], dos[2]}, DQ{dqs[0], dqs[1], dqs[2]}, DK{dks[0], dks[1], dks[2]}, DV{dvs[0], dvs[1], dvs[2]};
  const int group = H / Hkv;
  return parallel_for(B * Hkv, nthreads, T, [&](int n, Workspace& w) {
    const int b = n / Hkv, g = n % Hkv;
    const bf16* kg = k + b * K.batch + g * K.head;
    // K, V (dense, for whole-line tile loads) and K^T serve every query head of the group.
    transpose_into(kg, K.token, w.kv_t.data(), T, T);
    copy_rows(kg, K.token, w.k_rows.data(), T);
    copy_rows(v + b * V.batch + g * V.head, V.token, w.v_rows.data(), T);
    memset(w.dk.data(), 0, sizeof(float) * T * D);
    memset(w.dv.data(), 0, sizeof(float) * T * D);
    for (int h = g * group; h < (g + 1) * group; ++h)
      backward_head(q + b * Q.batch + h * Q.head, Q.token, o + b * O.batch + h * O.head, O.token,
                    dout + b * DO.batch + h * DO.head, DO.token, lse + ((long)b * H + h) * T,
                    dq + b * DQ.batch + h * DQ.head, DQ.token, T, scale, w);
    bf16* dkg = dk + b * DK.batch + g * DK.head;
    bf16* dvg = dv + b * DV.batch + g * DV.head;
    for (int t = 0; t < T; ++t) {
      store_bf16(dkg + t * DK.token, _mm512_mul_ps(_mm512_loadu_ps(w.dk.data() + t * D), _mm512_set1_ps(scale)));
      store_bf16(dvg + t * DV.token, _mm512_loadu_ps(w.dv.data() + t * D));
    }
  }) ? 0 : -1;
}
}
