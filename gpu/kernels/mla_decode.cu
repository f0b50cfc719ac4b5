// Absorbed MLA decode attention over quantized latent caches (fp8 e4m3 and rotated int4).
//
// Loaded by kvstore.gpu through cupy RawModule (NVRTC), so this file includes no headers: the
// tensor-core, conversion and shared-memory ops are inline PTX and every type is a builtin.
//
// Per query token b and head h, over the rows n of its sequence (or of its selection):
//   s[n]   = softmax_scale * (q_lat[h] . (lut[Lc[n]] * Ls[n]) + q_rope[h] . (lut[Rc[n]] * Rs[n]))
//   out[h] = softmax(s) @ (lut[Lc] * Ls)
// For the rotated int4 cache lut[c] is the Lloyd-Max level and the row scale radius/sqrtf(n); the
// query is rotated once (mla_prep_query), rows are attended in the rotated domain and the context
// is un-rotated once (mla_merge).
//
// Kernels (the v2 pair at the end of the file is the default for kv_lora 512; see there):
//   mla_prep_query   q f32 -> f16 (per-head power-of-two scale so f16 keeps full precision),
//                    rotated first for int4; one block per (head, batch).
//   mla_decode_split split-T (flash-decoding): block (head group, split, batch) streams BN-row
//                    tiles of its share of the sequence, keeps an online softmax and writes a
//                    partial context + log-sum-exp. mma.sync m16n8k16 f16 x f16 -> f32.
//   mla_merge        log-sum-exp merge of the partials (+ un-rotation for int4), one block per
//                    (head, batch), its warps striding over the splits.
//   mla_unrotate     un-rotates an int4 context in place (after the warpgroup-MMA kernels).
//
// Numerics: codes decode exactly into f16 (e4m3 is a subset of f16; the 16 int4 levels round to
// f16, relative error <= 2^-11); q and the softmax weights are rounded to f16 (q per head with a
// power-of-two scale, weights in [0, 1]); every product accumulates in f32.

#define THREADS 256
#define WARPS 8
#define BN 64
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
// Softmax weights go to f16 as p * Ls / c_blk * P_SCALE (<= 2^15): small weights stay normal f16.
#define P_SCALE 32768.0f

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// ---------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// c[0..3] += A(16x16, row) * B(16x8, col); f16 operands, f32 accumulators.
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte permute with the sign-replicate mode of the selector's bit 3 (which __byte_perm masks off).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// Two e4m3 bytes (low byte -> low half) to f16x2; exact (e4m3 values are f16 values).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two_codes) {
    u32 r;
    u16 v = (u16)two_codes;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
    return r;
}

__device__ __forceinline__ void ldg_chunk(const u8* p, uint2& v) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
}

__device__ __forceinline__ void ldg_chunk(const u8* p, u32& v) {
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
}

// The NaN codes 0x7F/0xFF read as 0: clear every byte whose low 7 bits are all set.
__device__ __forceinline__ u32 fp8_clear_nan(u32 w) {
    u32 t = (w & 0x7F7F7F7Fu) + 0x01010101u;  // a byte's msb is set iff its low 7 bits were 0x7F
    u32 m = prmt(t, 0u, 0xBA98u);           // replicate each byte's msb over the byte
    return w & ~m;
}

// ---------------------------------------------------------------------------------------------
// Rotation (FORMAT.md section 5)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ u32 tq_hash(u32 x) {
    x += 0x9E3779B9u;
    x = (x ^ (x >> 16)) * 0x85EBCA6Bu;
    x = (x ^ (x >> 13)) * 0xC2B2AE35u;
    return x ^ (x >> 16);
}

__device__ __forceinline__ float tq_sign(u32 i) {
    return (tq_hash(0x9E3779B9u ^ i) & 1u) ? -1.0f : 1.0f;
}

// In-place normalized FWHT of a shared array of n (power of two) floats; all threads call it.
__device__ void fwht_shared(float* a, int n) {
    for (int len = 1; len < n; len <<= 1) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            int i = (p / len) * 2 * len + (p % len);
            float x = a[i], y = a[i + len];
            a[i] = x + y;
            a[i + len] = x - y;
        }
        __syncthreads();
    }
    const float norm = 1.0f / sqrtf((float)n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) a[i] *= norm;
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// int4 codes -> f16 levels
// ---------------------------------------------------------------------------------------------

// The 8 level magnitudes (level[8 + j], j = 0..7) as f16, split into low and high bytes so that
// one prmt looks up four 3-bit indices at once.
struct LevelTable {
    u32 lo_a, lo_b, hi_a, hi_b;
};

__device__ __forceinline__ LevelTable make_level_table() {
    const float mag[8] = {0.128f, 0.388f, 0.657f, 0.942f, 1.256f, 1.618f, 2.069f, 2.733f};
    u32 lo[2] = {0u, 0u}, hi[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u32 h = f32_to_f16(mag[j]);
        lo[j >> 2] |= (h & 0xFFu) << (8 * (j & 3));
        hi[j >> 2] |= (h >> 8) << (8 * (j & 3));
    }
    LevelTable t;
    t.lo_a = lo[0];
    t.lo_b = lo[1];
    t.hi_a = hi[0];
    t.hi_b = hi[1];
    return t;
}

// Eight 4-bit codes (element 2k in the low nibble of byte k) to four f16x2 (element order kept).
// level[c] = +mag[c - 8] for c >= 8 and -mag[7 - c] for c < 8.
__device__ __forceinline__ void int4x8_to_f16(u32 w, const LevelTable& lt, u32* out) {
    const u32 neg = ~w & 0x88888888u;            // bit 3 of every nibble whose code is < 8
    const u32 flip = neg - (neg >> 3);           // 7 in those nibbles: c ^ 7 = 7 - c
    const u32 j = (w ^ flip) & 0x77777777u;      // magnitude index per nibble
    const u32 jh = j >> 16;
    const u32 lo_a = prmt(lt.lo_a, lt.lo_b, j);   // low bytes of elements 0..3
    u32 hi_a = prmt(lt.hi_a, lt.hi_b, j);
    const u32 lo_b = prmt(lt.lo_a, lt.lo_b, jh);  // elements 4..7
    u32 hi_b = prmt(lt.hi_a, lt.hi_b, jh);
    // Sign of element k to bit 7 of byte k: even elements' flags sit at bit 3 of a byte, odd at 7.
    const u32 neg4 = neg << 4;
    hi_a |= prmt(neg4, neg, 0x5140u) & 0x80808080u;
    hi_b |= prmt(neg4, neg, 0x7362u) & 0x80808080u;
    out[0] = prmt(lo_a, hi_a, 0x5140u);
    out[1] = prmt(lo_a, hi_a, 0x7362u);
    out[2] = prmt(lo_b, hi_b, 0x5140u);
    out[3] = prmt(lo_b, hi_b, 0x7362u);
}

// 8 codes -> 8 f16 (one 16-byte store)
__device__ __forceinline__ uint4 to_f16x8(const uint2& codes, const LevelTable&) {
    const u32 a = fp8_clear_nan(codes.x), b = fp8_clear_nan(codes.y);
    return make_uint4(e4m3x2_to_f16x2(a & 0xFFFFu), e4m3x2_to_f16x2(a >> 16), e4m3x2_to_f16x2(b & 0xFFFFu),
                      e4m3x2_to_f16x2(b >> 16));
}

__device__ __forceinline__ uint4 to_f16x8(u32 codes, const LevelTable& lt) {
    u32 h[4];
    int4x8_to_f16(codes, lt, h);
    return make_uint4(h[0], h[1], h[2], h[3]);
}

// ---------------------------------------------------------------------------------------------
// mla_prep_query: one block of 128 threads per (head, batch)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float block_max_128(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    return v;
}

// Power-of-two factor putting max|x| just under 2^14, where f16 keeps 11 significant bits.
__device__ __forceinline__ float f16_range_factor(float max_abs) {
    if (!(max_abs > 0.0f) || !(max_abs < 3.0e38f)) return 1.0f;
    int e;
    frexpf(max_abs, &e);  // max_abs < 2^e
    return ldexpf(1.0f, 14 - e);
}

template <int K, int R, bool ROTATE>
__global__ void __launch_bounds__(128) mla_prep_query(const float* __restrict__ q_lat,
                                                      const float* __restrict__ q_rope, int H, int Hp,
                                                      float score_scale, u16* __restrict__ q16,
                                                      float* __restrict__ qmul) {
    __shared__ float ql[K];
    __shared__ float qr[R];
    __shared__ float red[4];
    const int h = blockIdx.x, b = blockIdx.y;
    u16* dst = q16 + ((long long)b * Hp + h) * (K + R);
    float* mul = qmul + ((long long)b * Hp + h) * 2;
    if (h >= H) {  // padding head of the last head group: zero, never written out
        for (int i = threadIdx.x; i < K + R; i += blockDim.x) dst[i] = 0;
        if (threadIdx.x < 2) mul[threadIdx.x] = 0.0f;
        return;
    }
    const float* src_l = q_lat + ((long long)b * H + h) * K;
    const float* src_r = q_rope + ((long long)b * H + h) * R;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ql[i] = ROTATE ? src_l[i] * tq_sign(i) : src_l[i];
    for (int i = threadIdx.x; i < R; i += blockDim.x) qr[i] = ROTATE ? src_r[i] * tq_sign(i) : src_r[i];
    __syncthreads();
    if (ROTATE) {
        fwht_shared(ql, K);
        fwht_shared(qr, R);
    }
    float ml = 0.0f, mr = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ml = fmaxf(ml, fabsf(ql[i]));
    for (int i = threadIdx.x; i < R; i += blockDim.x) mr = fmaxf(mr, fabsf(qr[i]));
    ml = block_max_128(ml, red);
    mr = block_max_128(mr, red);
    const float fl = f16_range_factor(ml), fr = f16_range_factor(mr);
    for (int i = threadIdx.x; i < K; i += blockDim.x) dst[i] = f32_to_f16(ql[i] * fl);
    for (int i = threadIdx.x; i < R; i += blockDim.x) dst[K + i] = f32_to_f16(qr[i] * fr);
    if (threadIdx.x == 0) {
        mul[0] = score_scale / fl;
        mul[1] = score_scale / fr;
    }
}

// ---------------------------------------------------------------------------------------------
// mla_decode_split
// ---------------------------------------------------------------------------------------------

// Code bytes one thread moves per chunk: 8 fp8 codes (uint2) or 8 int4 codes (u32).
template <int FMT>
struct Chunk {
    typedef uint2 type;
};
template <>
struct Chunk<1> {
    typedef u32 type;
};

template <int MT, int K, int R, int FMT>
struct Cfg {
    static constexpr int HG = 16 * MT;              // heads per block
    static constexpr int D = K + R;                 // score width
    static constexpr int QS = D + 8;                // f16 per Q / tile row in smem (16 B pad)
    static constexpr int PS = BN + 8;               // f16 per P row
    static constexpr int SS = BN + 4;               // f32 per partial-score row
    static constexpr int KB = FMT == 0 ? K : K / 2; // code bytes of a latent row
    static constexpr int RB = FMT == 0 ? R : R / 2; // code bytes of a rope row
    // Staging moves chunks of 8 codes (fp8: 8 bytes, int4: 4 bytes), each becoming one 16-byte
    // f16 store, so a warp's stores are contiguous. A thread loads latent chunk column LCOL of rows
    // LROW0 + i * LSTRIDE (i < NL) and rope chunk column RCOL of rows RROW0 + j * RSTRIDE (j < NR);
    // a warp reads contiguous runs of a row and the addresses step by constants.
    static constexpr int CB = FMT == 0 ? 8 : 4;     // code bytes per chunk
    static constexpr int LCH = KB / CB;             // latent chunks per row
    static constexpr int RCH = RB / CB;             // rope chunks per row
    static constexpr int LSTRIDE = THREADS / LCH;
    static constexpr int NL = BN / LSTRIDE;
    static constexpr int RSTRIDE = THREADS / RCH;
    static constexpr int NR = BN * RCH >= THREADS ? BN / RSTRIDE : 1;
    static constexpr bool ROPE_ALL = BN * RCH >= THREADS;  // else only tid < BN * RCH holds one
    // Q.K^T: software-pipeline the fragments (next k-step loaded before this one's mma) where the
    // registers allow; with 4 m-tiles a warp has enough independent mma per k-step anyway.
    static constexpr bool PIPE_QK = MT <= 2;
    // Q.K^T: warp tile (MWQ m-tiles) x (NTQ n-tiles) over one half of the score width.
    static constexpr int MWQ = MT < 2 ? MT : 2;
    static constexpr int MGQ = MT / MWQ;
    static constexpr int NGQ = WARPS / (2 * MGQ);
    static constexpr int NTQ = (BN / 8) / NGQ;
    static constexpr int KS0 = D / 32;              // k-steps of the first half (latent only)
    // P.V: warp tile (MWP m-tiles) x (DW output dims).
    static constexpr int MWP = MT < 2 ? MT : 2;
    static constexpr int MGP = MT / MWP;
    static constexpr int DW = K / (WARPS / MGP);
    static constexpr int NTP = DW / 8;
    // softmax: TPH threads per head, RPT rows each
    static constexpr int TPH = THREADS / HG;
    static constexpr int RPT = BN / TPH;
    // Prefetch the next tile before Q.K^T when the registers allow, else before P.V.
    static constexpr bool EARLY = MT <= 2;
    // shared memory layout, bytes
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_T = OFF_Q + HG * QS * 2;
    static constexpr int OFF_S = OFF_T + BN * QS * 2;
    static constexpr int OFF_P = OFF_S + 2 * HG * SS * 4;
    static constexpr int OFF_LS = OFF_P + HG * PS * 2;
    static constexpr int OFF_RS = OFF_LS + BN * 4;
    static constexpr int OFF_VALID = OFF_RS + BN * 4;
    static constexpr int OFF_QM = OFF_VALID + BN * 4;
    static constexpr int OFF_ALPHA = OFF_QM + HG * 8;
    static constexpr int OFF_ML = OFF_ALPHA + HG * 4;
    static constexpr int OFF_CMAX = OFF_ML + HG * 8;
    static constexpr int SMEM = OFF_CMAX + (BN / 32) * 4;

    static_assert(K % 64 == 0 && R % 32 == 0, "kv_lora must be a multiple of 64, qk_rope of 32");
    static_assert(KS0 * 32 == D && KS0 <= K / 16, "score width must split into two k-halves");
    static_assert(NTQ % 2 == 0 && NTP % 2 == 0, "ldmatrix.x4 loads n-tiles in pairs");
    static_assert(THREADS % HG == 0 && BN % TPH == 0, "softmax thread mapping");
    static_assert(THREADS % LCH == 0 && BN % LSTRIDE == 0 && THREADS % RCH == 0, "staging thread mapping");
};

// The dynamic shared memory mla_decode_split<MT, K, R, FMT, *> needs (read once by the host).
template <int MT, int K, int R, int FMT>
__global__ void mla_split_smem(int* out) {
    out[0] = Cfg<MT, K, R, FMT>::SMEM;
}

// Rows the block reads: position pos of the sequence (or entry pos of the selection list).
template <bool GATHER>
__device__ __forceinline__ long long resolve_row(int pos, int T, long long start, int slen,
                                                 const int* sel_b, long long n_rows) {
    if (pos >= T) return -1;
    long long row;
    if (GATHER) {
        const int idx = __ldg(sel_b + pos);
        if (idx < 0 || idx >= slen) return -1;  // outside the sequence: never read
        row = start + idx;
    } else {
        row = start + pos;
    }
    return (row >= 0 && row < n_rows) ? row : -1;
}

template <int MT, int K, int R, int FMT, bool GATHER>
__global__ void __launch_bounds__(THREADS, MT == 1 ? 2 : 1)
    mla_decode_split(const u16* __restrict__ q16, const float* __restrict__ qmul,
                     const u8* __restrict__ lc, const float* __restrict__ lscale,
                     const u8* __restrict__ rc, const float* __restrict__ rscale,
                     const int* __restrict__ seq_start, const int* __restrict__ seq_len,
                     const int* __restrict__ sel, const int* __restrict__ n_sel, int sel_stride,
                     long long n_rows, int Hp, int n_splits, int blocks_per_split,
                     float* __restrict__ o_part, float* __restrict__ lse_part) {
    using C = Cfg<MT, K, R, FMT>;
    extern __shared__ __align__(16) unsigned char smem[];
    u16* Qs = (u16*)(smem + C::OFF_Q);
    u16* tile = (u16*)(smem + C::OFF_T);
    float* Sbuf = (float*)(smem + C::OFF_S);
    u16* Ps = (u16*)(smem + C::OFF_P);
    float* ls_s = (float*)(smem + C::OFF_LS);
    float* rs_s = (float*)(smem + C::OFF_RS);
    int* valid_s = (int*)(smem + C::OFF_VALID);
    float* qm_s = (float*)(smem + C::OFF_QM);
    float* alpha_s = (float*)(smem + C::OFF_ALPHA);
    float* ml_s = (float*)(smem + C::OFF_ML);
    float* cmax_s = (float*)(smem + C::OFF_CMAX);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int h0 = hg * C::HG;
    const long long start = seq_start[b];
    const int slen = seq_len[b];
    int T = slen;
    if (GATHER) T = min(n_sel[b], sel_stride);
    if (start < 0) T = 0;  // (validate=False with a bad start): attend nothing rather than read outside
    T = max(T, 0);
    const int* sel_b = GATHER ? sel + (long long)b * sel_stride : sel;
    const int n_blocks = (T + BN - 1) / BN;
    const int blk0 = split * blocks_per_split;
    const int blk1 = min(blk0 + blocks_per_split, n_blocks);
    float* lse_out = lse_part + ((long long)b * Hp + h0) * n_splits + split;
    if (blk0 >= blk1) {  // nothing to attend in this split: the merge gives it weight 0
        if (tid < C::HG) lse_out[(long long)tid * n_splits] = NEG_INF;
        return;
    }

    // Query tile of this head group, and its per-head score multipliers.
    {
        const u16* qsrc = q16 + ((long long)b * Hp + h0) * C::D;
        for (int i = tid; i < C::HG * (C::D / 8); i += THREADS) {
            const int h = i / (C::D / 8), c = i % (C::D / 8);
            *(uint4*)(Qs + h * C::QS + c * 8) = *(const uint4*)(qsrc + (long long)h * C::D + c * 8);
        }
        if (tid < 2 * C::HG) qm_s[tid] = qmul[((long long)b * Hp + h0) * 2 + tid];
    }
    LevelTable lt = {0u, 0u, 0u, 0u};
    if (FMT == 1) lt = make_level_table();

    // ---- staging: global codes -> registers -> f16 tile -------------------------------------
    typedef typename Chunk<FMT>::type chunk_t;
    const int lcol = tid % C::LCH, lrow0 = tid / C::LCH;
    const int rcol = tid % C::RCH, rrow0 = tid / C::RCH;
    const bool has_rope = C::ROPE_ALL || tid < BN * C::RCH;
    chunk_t st_lat[C::NL], st_rope[C::NR];
    float st_ls = 0.0f, st_rs = 0.0f;
    int st_valid = 0;

    auto stage_load = [&](int blk) {
        const int pos0 = blk * BN;
        if (!GATHER) {
            // rows pos0 .. pos0 + valid - 1 of the sequence exist (and lie inside the row arrays)
            const long long base = start + pos0;
            const int valid = (int)min((long long)min(T - pos0, BN), n_rows - base);
            const u8* lat = lc + (base + lrow0) * C::KB + lcol * C::CB;
#pragma unroll
            for (int i = 0; i < C::NL; ++i) {
                chunk_t v{};
                if (lrow0 + i * C::LSTRIDE < valid) ldg_chunk(lat + (long long)i * C::LSTRIDE * C::KB, v);
                st_lat[i] = v;
            }
            const u8* rope = rc + (base + rrow0) * C::RB + rcol * C::CB;
#pragma unroll
            for (int j = 0; j < C::NR; ++j) {
                chunk_t v{};
                if (has_rope && rrow0 + j * C::RSTRIDE < valid) ldg_chunk(rope + (long long)j * C::RSTRIDE * C::RB, v);
                st_rope[j] = v;
            }
            if (tid < BN) {
                st_valid = tid < valid;
                st_ls = st_valid ? __ldg(lscale + base + tid) : 0.0f;
                st_rs = st_valid ? __ldg(rscale + base + tid) : 0.0f;
            }
        } else {
#pragma unroll
            for (int i = 0; i < C::NL; ++i) {
                const long long g = resolve_row<GATHER>(pos0 + lrow0 + i * C::LSTRIDE, T, start, slen, sel_b, n_rows);
                chunk_t v{};
                if (g >= 0) ldg_chunk(lc + g * C::KB + lcol * C::CB, v);
                st_lat[i] = v;
            }
#pragma unroll
            for (int j = 0; j < C::NR; ++j) {
                const long long g = has_rope ? resolve_row<GATHER>(pos0 + rrow0 + j * C::RSTRIDE, T, start, slen,
                                                                   sel_b, n_rows)
                                             : -1;
                chunk_t v{};
                if (g >= 0) ldg_chunk(rc + g * C::RB + rcol * C::CB, v);
                st_rope[j] = v;
            }
            if (tid < BN) {
                const long long g = resolve_row<GATHER>(pos0 + tid, T, start, slen, sel_b, n_rows);
                st_valid = g >= 0;
                st_ls = st_valid ? __ldg(lscale + g) : 0.0f;
                st_rs = st_valid ? __ldg(rscale + g) : 0.0f;
            }
        }
    };

    auto stage_store = [&]() {
        u16* lat_dst = tile + lrow0 * C::QS + lcol * 8;
#pragma unroll
        for (int i = 0; i < C::NL; ++i) *(uint4*)(lat_dst + i * C::LSTRIDE * C::QS) = to_f16x8(st_lat[i], lt);
        u16* rope_dst = tile + rrow0 * C::QS + K + rcol * 8;
#pragma unroll
        for (int j = 0; j < C::NR; ++j)
            if (has_rope) *(uint4*)(rope_dst + j * C::RSTRIDE * C::QS) = to_f16x8(st_rope[j], lt);
        if (tid < BN) {
            // Row scales as the f16 tile needs them: fp8 codes decode to the e4m3 value itself;
            // int4 levels are in units of radius / sqrtf(n).
            float ls = st_ls, rs = st_rs;
            if (FMT == 1) {
                ls = st_ls / sqrtf((float)K);
                rs = st_rs / sqrtf((float)R);
            }
            ls_s[tid] = st_valid ? ls : 0.0f;
            rs_s[tid] = st_valid ? rs : 0.0f;
            valid_s[tid] = st_valid;
            float a = st_valid ? fabsf(ls) : 0.0f;
            for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, o));
            if (lane == 0) cmax_s[tid >> 5] = a;
        }
    };

    // ---- per-warp roles ----------------------------------------------------------------------
    const int g = lane >> 2, t4 = lane & 3;
    // ldmatrix lane -> (row, col) of the 8x8 matrices: A operands and transposed B operands use
    // (rows 0-7 | rows 8-15) x (cols 0-7 | cols 8-15) in matrix order 0,1,2,3 = (r0,c0),(r8,c0),(r0,c8),(r8,c8)
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
    // non-transposed B operand (rows = cache rows): matrices (r0,c0),(r0,c8),(r8,c0),(r8,c8)
    const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;

    const int qk_half = warp & 1;
    const int qk_ng = (warp >> 1) % C::NGQ;
    const int qk_mg = (warp >> 1) / C::NGQ;
    const int pv_mg = warp / (WARPS / C::MGP);
    const int pv_dq = warp % (WARPS / C::MGP);

    const u32 q_base = smem_addr(Qs), t_base = smem_addr(tile), p_base = smem_addr(Ps);

    // softmax role: TPH consecutive threads per head
    const int sm_h = tid / C::TPH, sm_p = tid % C::TPH;
    float m_run = NEG_INF, l_run = 0.0f, c_run = 0.0f;

    float o_acc[C::MWP][C::NTP][4];
#pragma unroll
    for (int m = 0; m < C::MWP; ++m)
#pragma unroll
        for (int n = 0; n < C::NTP; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.0f;

    stage_load(blk0);
    stage_store();
    __syncthreads();

    for (int blk = blk0; blk < blk1; ++blk) {
        const bool more = blk + 1 < blk1;
        if (C::EARLY && more) stage_load(blk + 1);

        // ---- S = Q K^T (scaled, log2 units), split over two halves of the score width -------
        {
            float acc[C::MWQ][C::NTQ][4];
            const int row0 = qk_ng * C::NTQ * 8;
            auto qk_load = [&](int ks, u32 (&af)[C::MWQ][4], u32 (&bf)[C::NTQ / 2][4]) {
#pragma unroll
                for (int m = 0; m < C::MWQ; ++m) {
                    const int hrow = (qk_mg * C::MWQ + m) * 16 + a_row;
                    ldsm_x4(q_base + (hrow * C::QS + ks * 16 + a_col) * 2, af[m][0], af[m][1], af[m][2], af[m][3]);
                }
#pragma unroll
                for (int np = 0; np < C::NTQ / 2; ++np) {
                    const int trow = row0 + np * 16 + b_row;
                    ldsm_x4(t_base + (trow * C::QS + ks * 16 + b_col) * 2, bf[np][0], bf[np][1], bf[np][2], bf[np][3]);
                }
            };
            auto qk_mma = [&](float (&c)[C::MWQ][C::NTQ][4], const u32 (&af)[C::MWQ][4], const u32 (&bf)[C::NTQ / 2][4]) {
#pragma unroll
                for (int np = 0; np < C::NTQ / 2; ++np)
#pragma unroll
                    for (int m = 0; m < C::MWQ; ++m) {
                        mma_16816(c[m][2 * np], af[m], bf[np][0], bf[np][1]);
                        mma_16816(c[m][2 * np + 1], af[m], bf[np][2], bf[np][3]);
                    }
            };
            float* S = Sbuf + qk_half * C::HG * C::SS;
            // half 0: latent k-steps [0, KS0); half 1: rope, then latent [KS0, K/16)
#pragma unroll 1
            for (int pass = 0; pass < 2; ++pass) {
                const bool rope = qk_half == 1 && pass == 0;
                if (qk_half == 0 && pass == 1) break;
                const int ks_begin = rope ? K / 16 : (qk_half == 0 ? 0 : C::KS0);
                const int ks_end = rope ? C::D / 16 : (qk_half == 0 ? C::KS0 : K / 16);
#pragma unroll
                for (int m = 0; m < C::MWQ; ++m)
#pragma unroll
                    for (int n = 0; n < C::NTQ; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
                if (C::PIPE_QK) {
                    u32 af0[C::MWQ][4], bf0[C::NTQ / 2][4], af1[C::MWQ][4], bf1[C::NTQ / 2][4];
                    qk_load(ks_begin, af0, bf0);
                    for (int ks = ks_begin; ks < ks_end; ks += 2) {
                        if (ks + 1 < ks_end) qk_load(ks + 1, af1, bf1);
                        qk_mma(acc, af0, bf0);
                        if (ks + 1 >= ks_end) break;
                        if (ks + 2 < ks_end) qk_load(ks + 2, af0, bf0);
                        qk_mma(acc, af1, bf1);
                    }
                } else {
#pragma unroll 2
                    for (int ks = ks_begin; ks < ks_end; ++ks) {
                        u32 af[C::MWQ][4], bf[C::NTQ / 2][4];
                        qk_load(ks, af, bf);
                        qk_mma(acc, af, bf);
                    }
                }
                // scale by row scale x per-head multiplier; the rope pass writes, the latent adds
                const float* rowscale = rope ? rs_s : ls_s;
                const int which = rope ? 1 : 0;
                const bool add = qk_half == 1 && !rope;
#pragma unroll
                for (int m = 0; m < C::MWQ; ++m) {
                    const int ha = (qk_mg * C::MWQ + m) * 16 + g, hb = ha + 8;
                    const float mula = qm_s[ha * 2 + which], mulb = qm_s[hb * 2 + which];
#pragma unroll
                    for (int n = 0; n < C::NTQ; ++n) {
                        const int r = row0 + n * 8 + 2 * t4;
                        const float s0 = rowscale[r], s1 = rowscale[r + 1];
                        float2* pa = (float2*)(S + ha * C::SS + r);
                        float2* pb = (float2*)(S + hb * C::SS + r);
                        float2 va = make_float2(acc[m][n][0] * s0 * mula, acc[m][n][1] * s1 * mula);
                        float2 vb = make_float2(acc[m][n][2] * s0 * mulb, acc[m][n][3] * s1 * mulb);
                        if (add) {
                            const float2 oa = *pa, ob = *pb;
                            va.x += oa.x; va.y += oa.y;
                            vb.x += ob.x; vb.y += ob.y;
                        }
                        *pa = va;
                        *pb = vb;
                    }
                }
            }
        }
        __syncthreads();

        // ---- online softmax: P' = p * Ls / c * P_SCALE in f16, c the running max row scale ----
        // c only grows and m only grows, so most tiles leave the context's scale alone and the
        // rescale below is skipped (the barrier reports whether any head needs it).
        bool rescale;
        {
            float c_blk = cmax_s[0];
#pragma unroll
            for (int i = 1; i < BN / 32; ++i) c_blk = fmaxf(c_blk, cmax_s[i]);
            const float c_new = fmaxf(c_run, c_blk);
            const float c_eff = c_new > 0.0f ? c_new : 1.0f;  // all scales zero so far: P' is 0 anyway
            const float p_mul = P_SCALE / c_eff;
            const float c_ratio = c_run > 0.0f ? c_run / c_eff : 1.0f;
            const float* S0 = Sbuf + sm_h * C::SS;
            const float* S1 = Sbuf + C::HG * C::SS + sm_h * C::SS;
            float sv[C::RPT];
            float mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < C::RPT; ++i) {
                const int r = sm_p + i * C::TPH;
                const float s = valid_s[r] ? S0[r] + S1[r] : NEG_INF;
                sv[i] = s;
                mx = fmaxf(mx, s);
            }
#pragma unroll
            for (int o = C::TPH / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
            const float m_new = fmaxf(m_run, mx);
            const float ref = m_new == NEG_INF ? 0.0f : m_new;
            const float alpha = exp2f(m_run - ref);
            float lsum = 0.0f;
#pragma unroll
            for (int i = 0; i < C::RPT; ++i) {
                const int r = sm_p + i * C::TPH;
                const float p = exp2f(sv[i] - ref);
                lsum += p;
                Ps[sm_h * C::PS + r] = f32_to_f16(p * ls_s[r] * p_mul);
            }
            l_run = l_run * alpha + lsum;
            m_run = m_new;
            const float factor = alpha * c_ratio;
            if (sm_p == 0) alpha_s[sm_h] = factor;
            c_run = c_new;
            rescale = __syncthreads_or(factor != 1.0f) != 0;
        }
        if (!C::EARLY && more) stage_load(blk + 1);

        // ---- O = alpha * O + P' V -------------------------------------------------------------
        {
            if (rescale) {
#pragma unroll
            for (int m = 0; m < C::MWP; ++m) {
                const int ha = (pv_mg * C::MWP + m) * 16 + g;
                const float aa = alpha_s[ha], ab = alpha_s[ha + 8];
#pragma unroll
                for (int n = 0; n < C::NTP; ++n) {
                    o_acc[m][n][0] *= aa;
                    o_acc[m][n][1] *= aa;
                    o_acc[m][n][2] *= ab;
                    o_acc[m][n][3] *= ab;
                }
            }
            }
            const int d0 = pv_dq * C::DW;
#pragma unroll
            for (int ks = 0; ks < BN / 16; ++ks) {
                u32 pf[C::MWP][4];
#pragma unroll
                for (int m = 0; m < C::MWP; ++m) {
                    const int hrow = (pv_mg * C::MWP + m) * 16 + a_row;
                    ldsm_x4(p_base + (hrow * C::PS + ks * 16 + a_col) * 2, pf[m][0], pf[m][1], pf[m][2], pf[m][3]);
                }
#pragma unroll
                for (int np = 0; np < C::NTP / 2; ++np) {
                    u32 v0, v1, v2, v3;
                    ldsm_x4_trans(t_base + ((ks * 16 + a_row) * C::QS + d0 + np * 16 + a_col) * 2, v0, v1, v2, v3);
#pragma unroll
                    for (int m = 0; m < C::MWP; ++m) {
                        mma_16816(o_acc[m][2 * np], pf[m], v0, v1);
                        mma_16816(o_acc[m][2 * np + 1], pf[m], v2, v3);
                    }
                }
            }
        }
        if (more) {
            __syncthreads();
            stage_store();
            __syncthreads();
        }
    }

    // ---- epilogue: normalized partial context and its log-sum-exp (log2 units) ---------------
#pragma unroll
    for (int o = C::TPH / 2; o > 0; o >>= 1) l_run += __shfl_xor_sync(FULL_MASK, l_run, o);
    if (sm_p == 0) {
        ml_s[sm_h * 2] = m_run;
        ml_s[sm_h * 2 + 1] = l_run;
        lse_out[(long long)sm_h * n_splits] = l_run > 0.0f ? m_run + log2f(l_run) : NEG_INF;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < C::MWP; ++m) {
        const int ha = (pv_mg * C::MWP + m) * 16 + g, hb = ha + 8;
        const float la = ml_s[ha * 2 + 1], lb = ml_s[hb * 2 + 1];
        const float c_eff = c_run > 0.0f ? c_run : 1.0f;
        const float fa = la > 0.0f ? c_eff / (P_SCALE * la) : 0.0f;
        const float fb = lb > 0.0f ? c_eff / (P_SCALE * lb) : 0.0f;
        float* oa = o_part + (((long long)b * Hp + h0 + ha) * n_splits + split) * K;
        float* ob = o_part + (((long long)b * Hp + h0 + hb) * n_splits + split) * K;
#pragma unroll
        for (int n = 0; n < C::NTP; ++n) {
            const int d = pv_dq * C::DW + n * 8 + 2 * t4;
            *(float2*)(oa + d) = make_float2(o_acc[m][n][0] * fa, o_acc[m][n][1] * fa);
            *(float2*)(ob + d) = make_float2(o_acc[m][n][2] * fb, o_acc[m][n][3] * fb);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// mla_merge: one block of 256 threads per (head, batch); warps take every 8th split
// ---------------------------------------------------------------------------------------------

// Log-sum-exp merge weights of one (head, sequence)'s n_splits partials: weights[s] = 2^(lse[s] -
// max) into shared memory (visible to the block on return); returns 1 / their sum, 0 when every
// split is empty. Called by all 256 threads of a merge block; red is 8 floats of shared scratch.
__device__ __forceinline__ float lse_merge_weights(const float* lse, int n_splits, float* weights, float* red) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float mx = NEG_INF;
    for (int s = tid; s < n_splits; s += 256) mx = fmaxf(mx, lse[s]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) mx = fmaxf(mx, red[i]);
    __syncthreads();
    float tot = 0.0f;
    for (int s = tid; s < n_splits; s += 256) {
        const float w = mx == NEG_INF ? 0.0f : exp2f(lse[s] - mx);
        weights[s] = w;
        tot += w;
    }
    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(FULL_MASK, tot, o);
    if (lane == 0) red[warp] = tot;
    __syncthreads();
    tot = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) tot += red[i];
    return tot > 0.0f ? 1.0f / tot : 0.0f;
}

template <int K, bool UNROTATE>
__global__ void __launch_bounds__(256) mla_merge(const float* __restrict__ o_part,
                                                 const float* __restrict__ lse_part, int H, int Hp,
                                                 int n_splits, float* __restrict__ out) {
    extern __shared__ float weights[];  // [n_splits]
    __shared__ float4 part[8][K / 4];   // per-warp sums
    __shared__ float ctx[K];
    __shared__ float red[8];
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* lse = lse_part + ((long long)b * Hp + h) * n_splits;
    const float inv = lse_merge_weights(lse, n_splits, weights, red);

    // An empty split (weight 0) never wrote its partial: the select drops whatever is there.
    const float4* op = (const float4*)(o_part + ((long long)b * Hp + h) * n_splits * K);
    float4 acc[K / 128];
#pragma unroll
    for (int j = 0; j < K / 128; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 2
    for (int s = warp; s < n_splits; s += 8) {
        const float w = weights[s];
        const bool live = w > 0.0f;
#pragma unroll
        for (int j = 0; j < K / 128; ++j) {
            // An empty split's partial is not even read: a ragged batch whose plan is bounded by
            // the whole row array has mostly empty splits.
            const float4 v = live ? op[(long long)s * (K / 4) + lane + 32 * j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            acc[j].x += live ? w * v.x : 0.0f;
            acc[j].y += live ? w * v.y : 0.0f;
            acc[j].z += live ? w * v.z : 0.0f;
            acc[j].w += live ? w * v.w : 0.0f;
        }
    }
#pragma unroll
    for (int j = 0; j < K / 128; ++j) part[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int i = tid; i < K / 4; i += 256) {
        float4 sum = part[0][i];
#pragma unroll
        for (int w = 1; w < 8; ++w) {
            sum.x += part[w][i].x;
            sum.y += part[w][i].y;
            sum.z += part[w][i].z;
            sum.w += part[w][i].w;
        }
        sum = make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv);
        if constexpr (UNROTATE) {
            ctx[4 * i] = sum.x;
            ctx[4 * i + 1] = sum.y;
            ctx[4 * i + 2] = sum.z;
            ctx[4 * i + 3] = sum.w;
        } else {
            ((float4*)(out + ((long long)b * H + h) * K))[i] = sum;
        }
    }
    if constexpr (UNROTATE) {
        __syncthreads();
        fwht_shared(ctx, K);
        for (int d = tid; d < K; d += 256) out[((long long)b * H + h) * K + d] = ctx[d] * tq_sign((u32)d);
    }
}

// mla_unrotate: one block of 128 threads per (sequence, head) row of out f32[B, H, K], in place:
// the warpgroup-MMA kernels (kvstore.gpu.wgmma_kernels) attend int4 rows in the rotated domain.
template <int K>
__global__ void __launch_bounds__(128) mla_unrotate(float* __restrict__ out) {
    __shared__ float ctx[K];
    float* row = out + (long long)blockIdx.x * K;
    for (int d = threadIdx.x; d < K; d += blockDim.x) ctx[d] = row[d];
    __syncthreads();
    fwht_shared(ctx, K);
    for (int d = threadIdx.x; d < K; d += blockDim.x) row[d] = ctx[d] * tq_sign((u32)d);
}

// =============================================================================================
// v2 kernels (kv_lora 512): two launches, no f16 staging tile.
//
//   mla_decode_v2  prepares its own query tile (rotated for int4), streams the raw code rows
//                  into a two-stage shared-memory ring with cp.async (tile i+1 lands while tile
//                  i is computed), and converts codes to f16 as the mma fragments are loaded:
//                  Q.K^T reads B fragments with ldmatrix straight from the code bytes (the query
//                  columns are stored in the matching permuted order), P.V reads them with
//                  ldmatrix.trans (output dims come out permuted and are written back in order).
//                  Ring stages are swizzled (see Cfg2): copies fill aligned 128-byte lines and
//                  ldmatrix reads stay conflict-free without padding.
//                  fp8 NaN codes are not cleared on the fast path: a NaN score flags the tile in
//                  the softmax, the block undoes that softmax step, clears the tile's NaN codes and
//                  scores it again (rare path).
//                  For int4 the partial context is un-rotated here, so the merge is the same for
//                  both formats. Partial contexts are stored as f16 with a power-of-two scale.
//   mla_merge_v2   log-sum-exp merge, one block per (head, 32-dim chunk, sequence).
// =============================================================================================

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x1(u32 addr, u32& r0) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r0) : "r"(addr) : "memory");
}

// Low two e4m3 bytes of w -> f16x2 (the high bytes are ignored).
__device__ __forceinline__ u32 e4m3_lo_to_f16x2(u32 w) {
    u32 r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(w));
    return r;
}

__device__ __forceinline__ u32 e4m3_hi_to_f16x2(u32 w) {
    u32 r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(w));
    return r;
}

// Warp-wide normalized FWHT of 32 * NV values: lane l holds v[j], element index given by the
// caller's layout; the transform is separable over index bits, so in-lane butterflies run over the
// register-index bits and cross-lane ones over the lane bits.
template <int NV>
__device__ __forceinline__ void fwht_warp(float (&v)[NV], int lane, float norm) {
#pragma unroll
    for (int len = 1; len < NV; len <<= 1)
#pragma unroll
        for (int j = 0; j < NV; ++j)
            if (!(j & len)) {
                const float x = v[j], y = v[j + len];
                v[j] = x + y;
                v[j + len] = x - y;
            }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = lane & m;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const float o = __shfl_xor_sync(FULL_MASK, v[j], m);
            v[j] = upper ? o - v[j] : v[j] + o;
        }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] *= norm;
}

// f16x2 (low half first) to two floats (exact)
__device__ __forceinline__ float2 f16x2_to_f32x2(u32 w) {
    float2 r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
        : "=f"(r.x), "=f"(r.y)
        : "r"(w));
    return r;
}

// 2^x (ex2.approx.ftz: ~2 ulp, results below 2^-126 flush to 0; 2^-inf = 0)
__device__ __forceinline__ float ex2_fast(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

template <int MT, int K, int R, int FMT>
struct Cfg2 {
    static constexpr int HG = 16 * MT;
    static constexpr int D = K + R;
    static constexpr int QS = D + 8;                  // f16 per Q row (16 B pad)
    static constexpr int KB = FMT == 0 ? K : K / 2;   // code bytes per latent row
    static constexpr int RB = FMT == 0 ? R : R / 2;   // code bytes per rope row
    static constexpr int KSB = FMT == 0 ? 1 : 2;      // k-steps per 16-byte block of a row
    static constexpr int LB = KB / 16;                // latent blocks per row
    static constexpr int RBK = RB / 16;               // rope blocks per row
    static constexpr int LB0 = (LB + RBK) / 2;        // latent blocks of the first Q.K^T half
    static constexpr int LSTR = THREADS / LB;         // staging: rows per pass (latent)
    static constexpr int NL = BN / LSTR;
    static constexpr int RSTR = THREADS / RBK;        // rows per pass (rope)
    static constexpr int NR = (BN + RSTR - 1) / RSTR;
    // Ring stage: BN latent rows of KB bytes, then BN rope rows of RB bytes, no padding; 16-byte
    // chunk c of latent row r sits at c ^ (r & 7), of rope row r at c ^ ((r >> RSH) & (RBK - 1)):
    // 8 consecutive rows of one chunk (an ldmatrix matrix) fall in 8 different bank groups, and the
    // 8 threads copying one 128-byte line of a row write one aligned 128-byte line.
    static constexpr int RSH = RBK == 4 ? 1 : (RBK == 2 ? 2 : 3);  // log2(rows per 128 bytes of rope)
    static constexpr int TLAT = BN * KB;
    static constexpr int TILE = TLAT + BN * RB;
    static constexpr int PS = BN + 8;
    static constexpr int SS = BN + 8;                 // 8 (mod 32) banks per head row: float2 stores of 8 heads conflict-free
    static constexpr int TPH = THREADS / HG;
    static constexpr int RPT = BN / TPH;
    static constexpr int DW = K / WARPS;              // output dims per warp in P.V
    static constexpr int NTP = DW / 8;
    static constexpr int CS = K + 4;                  // f32 per context row in the epilogue
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_T = OFF_Q + HG * QS * 2;
    static constexpr int OFF_S = OFF_T + 2 * TILE;
    static constexpr int OFF_P = OFF_S + 2 * HG * SS * 4;
    static constexpr int OFF_LS = OFF_P + HG * PS * 2;
    static constexpr int OFF_RS = OFF_LS + 2 * BN * 4;
    static constexpr int OFF_VALID = OFF_RS + 2 * BN * 4;
    static constexpr int OFF_QM = OFF_VALID + 2 * BN * 4;
    static constexpr int OFF_ALPHA = OFF_QM + HG * 8;
    static constexpr int OFF_ML = OFF_ALPHA + HG * 4;
    static constexpr int OFF_NAN = OFF_ML + HG * 8;   // 1 + the last tile whose scores held NaN
    static constexpr int MAIN = OFF_NAN + 16;
    static constexpr int CTX = HG * CS * 4;           // epilogue context (overlays the above)
    static constexpr int SMEM = MAIN > CTX ? MAIN : CTX;

    static_assert(K == 512, "v2 is built for kv_lora 512");
    static_assert(R == 32 || R == 64, "qk_rope 32 or 64");
    static_assert(THREADS % LB == 0 && BN % LSTR == 0, "latent staging map");
    static_assert(DW == 64 && NTP == 8, "P.V warp tile");
    static_assert(RPT % 4 == 0, "softmax rows per thread in float4 steps");
    static_assert(THREADS % HG == 0 && BN % TPH == 0, "softmax thread mapping");
    static_assert(OFF_T % 128 == 0 && TILE % 128 == 0 && KB % 128 == 0, "swizzled rows start on 128-byte lines");
    static_assert(LSTR % 8 == 0 && ((RSTR >> RSH) % RBK) == 0, "copy passes keep each row's swizzle");
};

template <int MT, int K, int R, int FMT>
__global__ void mla_split_smem_v2(int* out) {
    out[0] = Cfg2<MT, K, R, FMT>::SMEM;
}

// Logical position (the mma k order of the query tile) of feature f of the concatenated
// [latent | rope] query, matching how a thread's ldmatrix word of code bytes feeds b0/b1:
// fp8: the 4 bytes 4t..4t+3 of a 16-byte block are k = 2t, 2t+1, 2t+8, 2t+9 of one k-step;
// int4: the 8 nibbles 8t..8t+7 of a 16-byte block are those k of two k-steps (4 nibbles each).
template <int FMT>
__device__ __forceinline__ int qk_position(int f) {
    if (FMT == 0) {
        const int blk = f >> 4, r = f & 15;
        return blk * 16 + ((r >> 1) & 1) * 8 + (r >> 2) * 2 + (r & 1);
    } else {
        const int blk = f >> 5, r = f & 31;
        return blk * 32 + ((r >> 2) & 1) * 16 + ((r >> 1) & 1) * 8 + (r >> 3) * 2 + (r & 1);
    }
}

// Q.K^T over NB consecutive 16-byte blocks of the code tile from block `blk_first` (the query's
// k position), chunk `c_first` of their region (latent or rope rows) (v2), for a warp holding MW
// m-tiles from m-tile `m_first` and NT n-tiles (2: rows n0..n0+15; 4: and the 16 rows `row_step`
// bytes further): B fragments by ldmatrix of code bytes (matrices (rows n0..+7 | n0+8..+15) x
// (chunk | chunk + 1)), converted in registers; A fragments (query, qk_position order) by
// ldmatrix, each feeding NT mma. cb[k] is this lane's address of swizzled chunk 2k (+ its matrix's
// chunk offset) in the region's 8-chunk line; an odd chunk is loaded alone (x2, lanes 0-15 whose
// offset is 0: the XOR's low bit flips; row_step is a multiple of 256, so it leaves that bit
// alone). acc0 / acc1: even / odd blocks (two mma chains; the same array for one), [m][n-tile][4].
template <int NB, int MW, int NT, int FMT, int QS>
__device__ __forceinline__ void qk_blocks_v2(int blk_first, int c_first, const u32 (&cb)[4], u32 row_step, u32 q_base,
                                             int m_first, int a_row, int a_col, const LevelTable& lt,
                                             float (&acc0)[MW][NT][4], float (&acc1)[MW][NT][4]) {
    constexpr int KSB = FMT == 0 ? 1 : 2;
    constexpr int HF = NT / 2;  // 16-row halves
#pragma unroll
    for (int i = 0; i < NB;) {
        const int c = c_first + i;
        const int nb = ((c & 1) || i + 1 == NB) ? 1 : 2;
        const u32 line = cb[(c & 7) >> 1] + ((c & ~7) << 4);
        u32 w[HF][4];
#pragma unroll
        for (int hf = 0; hf < HF; ++hf) {
            const u32 at = line + hf * row_step;
            if (nb == 2) ldsm_x4(at, w[hf][0], w[hf][1], w[hf][2], w[hf][3]);
            else ldsm_x2((c & 1) ? at ^ 16u : at, w[hf][0], w[hf][1]);
        }
#pragma unroll
        for (int jb = 0; jb < 2; ++jb) {
            if (jb >= nb) break;
            float (&acc)[MW][NT][4] = jb ? acc1 : acc0;
            u32 bb[NT][KSB][2];  // n-tile 2 hf + e: rows n0 + 16 hf + 8 e ..
#pragma unroll
            for (int hf = 0; hf < HF; ++hf)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 wv = w[hf][2 * jb + e];
                    if (FMT == 0) {
                        bb[2 * hf + e][0][0] = e4m3_lo_to_f16x2(wv);
                        bb[2 * hf + e][0][1] = e4m3_hi_to_f16x2(wv);
                    } else {
                        u32 h[4];
                        int4x8_to_f16(wv, lt, h);
                        bb[2 * hf + e][0][0] = h[0];
                        bb[2 * hf + e][0][1] = h[1];
                        bb[2 * hf + e][KSB - 1][0] = h[2];
                        bb[2 * hf + e][KSB - 1][1] = h[3];
                    }
                }
#pragma unroll
            for (int s = 0; s < KSB; ++s) {
                const int ks = (blk_first + i + jb) * KSB + s;
#pragma unroll
                for (int m = 0; m < MW; ++m) {
                    u32 af[4];
                    ldsm_x4(q_base + (((m_first + m) * 16 + a_row) * QS + ks * 16 + a_col) * 2, af[0], af[1], af[2],
                            af[3]);
#pragma unroll
                    for (int n = 0; n < NT; ++n) mma_16816(acc[m][n], af, bb[n][s][0], bb[n][s][1]);
                }
            }
        }
        i += nb;
    }
}

template <int MT, int K, int R, int FMT, bool GATHER>
__global__ void __launch_bounds__(THREADS, MT == 1 ? 2 : 1)
    mla_decode_v2(const float* __restrict__ q_lat, const float* __restrict__ q_rope, int H, float score_scale,
                  const u8* __restrict__ lc, const float* __restrict__ lscale,
                  const u8* __restrict__ rc, const float* __restrict__ rscale,
                  const int* __restrict__ seq_start, const int* __restrict__ seq_len,
                  const int* __restrict__ sel, const int* __restrict__ n_sel, int sel_stride,
                  long long n_rows, int Hp, int n_splits, int blocks_per_split,
                  u16* __restrict__ o_part, float* __restrict__ o_scale, float* __restrict__ lse_part,
                  int* __restrict__ n_live) {
    using C = Cfg2<MT, K, R, FMT>;
    extern __shared__ __align__(128) unsigned char smem[];
    u16* Qs = (u16*)(smem + C::OFF_Q);
    float* Sbuf = (float*)(smem + C::OFF_S);
    u16* Ps = (u16*)(smem + C::OFF_P);
    float* ls_s = (float*)(smem + C::OFF_LS);
    float* rs_s = (float*)(smem + C::OFF_RS);
    int* valid_s = (int*)(smem + C::OFF_VALID);
    float* qm_s = (float*)(smem + C::OFF_QM);
    float* alpha_s = (float*)(smem + C::OFF_ALPHA);
    float* ml_s = (float*)(smem + C::OFF_ML);
    int* nan_s = (int*)(smem + C::OFF_NAN);
    float* ctx = (float*)smem;  // epilogue only

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hg = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int h0 = hg * C::HG;
    const long long start = seq_start[b];
    const int slen = seq_len[b];
    int T = slen;
    if (GATHER) T = min(n_sel[b], sel_stride);
    if (start < 0) T = 0;
    T = max(T, 0);
    const int* sel_b = GATHER ? sel + (long long)b * sel_stride : sel;
    const int n_blocks = (T + BN - 1) / BN;
    const int blk0 = split * blocks_per_split;
    const int blk1 = min(blk0 + blocks_per_split, n_blocks);
    // the merge weighs only the splits that hold rows (the first n_live): a plan bounded by the
    // whole row array (lengths on the device) has mostly empty ones
    if (split == 0 && hg == 0 && tid == 0) n_live[b] = min((n_blocks + blocks_per_split - 1) / blocks_per_split, n_splits);
    float* lse_out = lse_part + ((long long)b * Hp + h0) * n_splits + split;
    if (blk0 >= blk1) {
        if (tid < C::HG) lse_out[(long long)tid * n_splits] = NEG_INF;
        return;
    }

    const u32 t_base = smem_addr(smem + C::OFF_T);
    const u32 ls_base = smem_addr(ls_s), rs_base = smem_addr(rs_s);

    // byte offsets in a ring stage of chunk c of latent / rope row r (the swizzle of Cfg2)
    auto lat_at = [](int r, int c) -> u32 { return r * C::KB + ((c ^ (r & 7)) << 4); };
    auto rope_at = [](int r, int c) -> u32 {
        return C::TLAT + r * C::RB + ((c ^ ((r >> C::RSH) & (C::RBK - 1))) << 4);
    };

    // ---- staging: cp.async of raw code rows into ring slot `buf`; rows outside the sequence
    // (or the row arrays) are zero-filled, so their codes are finite and their scales 0 ---------
    const int lcol = tid % C::LB, lrow0 = tid / C::LB;
    const int rcol = tid % C::RBK, rrow0 = tid / C::RBK;
    auto issue = [&](int blk, int buf) {
        const int pos0 = blk * BN;
        const u32 tb = t_base + buf * C::TILE;
        if (!GATHER) {
            const long long base = start + pos0;
            const int valid = (int)min((long long)min(T - pos0, BN), n_rows - base);
            if (valid == BN) {  // whole tile inside the sequence: constant offsets, no predicates
                const u8* lat = lc + (base + lrow0) * C::KB + lcol * 16;
                const u32 dl = tb + lat_at(lrow0, lcol);
#pragma unroll
                for (int i = 0; i < C::NL; ++i) cp_async16(dl + i * C::LSTR * C::KB, lat + i * C::LSTR * C::KB, 16u);
                const u8* rope = rc + (base + rrow0) * C::RB + rcol * 16;
                const u32 dr = tb + rope_at(rrow0, rcol);
#pragma unroll
                for (int j = 0; j < C::NR; ++j)
                    if (rrow0 + j * C::RSTR < BN) cp_async16(dr + j * C::RSTR * C::RB, rope + j * C::RSTR * C::RB, 16u);
                if (tid < BN) {
                    cp_async4(ls_base + (buf * BN + tid) * 4, lscale + base + tid, 4u);
                    cp_async4(rs_base + (buf * BN + tid) * 4, rscale + base + tid, 4u);
                    valid_s[buf * BN + tid] = 1;
                }
                cp_async_commit();
                return;
            }
#pragma unroll
            for (int i = 0; i < C::NL; ++i) {
                const int r = lrow0 + i * C::LSTR;
                const bool ok = r < valid;
                const u8* src = ok ? lc + (base + r) * C::KB + lcol * 16 : lc;
                cp_async16(tb + lat_at(r, lcol), src, ok ? 16u : 0u);
            }
#pragma unroll
            for (int j = 0; j < C::NR; ++j) {
                const int r = rrow0 + j * C::RSTR;
                if (r < BN) {
                    const bool ok = r < valid;
                    const u8* src = ok ? rc + (base + r) * C::RB + rcol * 16 : rc;
                    cp_async16(tb + rope_at(r, rcol), src, ok ? 16u : 0u);
                }
            }
            if (tid < BN) {
                const bool ok = tid < valid;
                cp_async4(ls_base + (buf * BN + tid) * 4, ok ? lscale + base + tid : lscale, ok ? 4u : 0u);
                cp_async4(rs_base + (buf * BN + tid) * 4, ok ? rscale + base + tid : rscale, ok ? 4u : 0u);
                valid_s[buf * BN + tid] = ok;
            }
        } else {
#pragma unroll
            for (int i = 0; i < C::NL; ++i) {
                const int r = lrow0 + i * C::LSTR;
                const long long g = resolve_row<GATHER>(pos0 + r, T, start, slen, sel_b, n_rows);
                const u8* src = g >= 0 ? lc + g * C::KB + lcol * 16 : lc;
                cp_async16(tb + lat_at(r, lcol), src, g >= 0 ? 16u : 0u);
            }
#pragma unroll
            for (int j = 0; j < C::NR; ++j) {
                const int r = rrow0 + j * C::RSTR;
                if (r < BN) {
                    const long long g = resolve_row<GATHER>(pos0 + r, T, start, slen, sel_b, n_rows);
                    const u8* src = g >= 0 ? rc + g * C::RB + rcol * 16 : rc;
                    cp_async16(tb + rope_at(r, rcol), src, g >= 0 ? 16u : 0u);
                }
            }
            if (tid < BN) {
                const long long g = resolve_row<GATHER>(pos0 + tid, T, start, slen, sel_b, n_rows);
                cp_async4(ls_base + (buf * BN + tid) * 4, g >= 0 ? lscale + g : lscale, g >= 0 ? 4u : 0u);
                cp_async4(rs_base + (buf * BN + tid) * 4, g >= 0 ? rscale + g : rscale, g >= 0 ? 4u : 0u);
                valid_s[buf * BN + tid] = g >= 0;
            }
        }
        cp_async_commit();
    };

    issue(blk0, 0);
    if (tid == 0) *nan_s = 0;  // visible from the tile loop's first barrier on

    // ---- query tile: f16 with a per-head power-of-two scale, columns in qk_position order ----
    // (int4: signs then the normalized FWHT first). One warp per head; lane l holds latent
    // elements 128 j + 4 l + e (float4 loads) and rope elements NRV l + e.
    {
        constexpr int NRV = R / 32;
        for (int hl = warp; hl < C::HG; hl += WARPS) {
            const int h = h0 + hl;
            u16* dst = Qs + hl * C::QS;
            if (h >= H) {
                for (int i = lane; i < C::D; i += 32) dst[i] = 0;
                if (lane < 2) qm_s[hl * 2 + lane] = 0.0f;
                continue;
            }
            const float* src_l = q_lat + ((long long)b * H + h) * K;
            const float* src_r = q_rope + ((long long)b * H + h) * R;
            float v[16], w[NRV];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 x = *(const float4*)(src_l + 128 * j + 4 * lane);
                v[4 * j] = x.x;
                v[4 * j + 1] = x.y;
                v[4 * j + 2] = x.z;
                v[4 * j + 3] = x.w;
            }
#pragma unroll
            for (int e = 0; e < NRV; ++e) w[e] = src_r[NRV * lane + e];
            if (FMT == 1) {
#pragma unroll
                for (int j = 0; j < 16; ++j) v[j] *= tq_sign((u32)(128 * (j >> 2) + 4 * lane + (j & 3)));
#pragma unroll
                for (int e = 0; e < NRV; ++e) w[e] *= tq_sign((u32)(NRV * lane + e));
                // register-index bits (0,1,2,3) are element bits (0,1,7,8); lane bits are 2..6
                fwht_warp<16>(v, lane, 1.0f / sqrtf((float)K));
                fwht_warp<NRV>(w, lane, 1.0f / sqrtf((float)R));
            }
            float ml = 0.0f, mr = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; ++j) ml = fmaxf(ml, fabsf(v[j]));
#pragma unroll
            for (int e = 0; e < NRV; ++e) mr = fmaxf(mr, fabsf(w[e]));
            for (int o = 16; o > 0; o >>= 1) {
                ml = fmaxf(ml, __shfl_xor_sync(FULL_MASK, ml, o));
                mr = fmaxf(mr, __shfl_xor_sync(FULL_MASK, mr, o));
            }
            const float fl = f16_range_factor(ml), fr = f16_range_factor(mr);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int f = 128 * (j >> 2) + 4 * lane + (j & 3);
                dst[qk_position<FMT>(f)] = f32_to_f16(v[j] * fl);
            }
#pragma unroll
            for (int e = 0; e < NRV; ++e) dst[qk_position<FMT>(K + NRV * lane + e)] = f32_to_f16(w[e] * fr);
            if (lane == 0) {
                qm_s[hl * 2] = score_scale / fl * (FMT == 1 ? rsqrtf((float)K) : 1.0f);
                qm_s[hl * 2 + 1] = score_scale / fr * (FMT == 1 ? rsqrtf((float)R) : 1.0f);
            }
        }
    }
    LevelTable lt = {0u, 0u, 0u, 0u};
    if (FMT == 1) lt = make_level_table();

    // ---- warp roles ----------------------------------------------------------------------------
    const int g = lane >> 2, t4 = lane & 3;
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
    // Q.K^T: warps split the score width in halves, and then the tile's rows in four groups of 16
    // (all the block's heads); fp8 with 64 heads (WIDE): two groups of 32 heads x two of 32 rows.
    // WIDE halves the query's ldmatrix traffic and converts each code twice; H200, 1M rows: fp8
    // 64 heads 596 -> 564 us, 128 heads 1,154 -> 1,082 us; int4, whose conversion costs ~4x fp8's,
    // 645 -> 717 us, so int4 keeps the narrow tiling.
    constexpr bool WIDE = MT == 4 && FMT == 0;
    constexpr int MW = WIDE ? 2 : MT;  // m-tiles per warp
    constexpr int NT = WIDE ? 4 : 2;   // n-tiles per warp
    const int qk_half = warp & 1;
    const int n0 = WIDE ? (warp >> 2) * 32 : (warp >> 1) * 16;
    const int m_first = WIDE ? ((warp >> 1) & 1) * MW : 0;
    // Q.K^T B operand (non-transposed ldmatrix of code bytes): matrices (rows n0..+7 | n0+8..+15)
    // x (block | block + 1)
    const int bq_row = n0 + (lane & 7) + ((lane >> 3) & 1) * 8, bq_blk = lane >> 4;
    // P.V B operand (transposed ldmatrix): matrices (rows 0-7 | 8-15) x (16-byte column 0 | 1)
    const int bv_row = (lane & 7) + ((lane >> 3) & 1) * 8, bv_col = (lane >> 4) * 16;
    const int d0 = warp * C::DW;
    const u32 q_base = smem_addr(Qs), p_base = smem_addr(Ps);

    const int sm_h = tid / C::TPH, sm_p = tid % C::TPH;
    float m_run = NEG_INF, l_run = 0.0f, c_run = 0.0f;

    float o_acc[MT][C::NTP][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < C::NTP; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.0f;

    // Scores of this warp's n-tiles (rows n0 + 8 n + 2 t4, +1; heads 16 (m_first + m) + g, +8; its
    // half of the score width) from its mma accumulators: scaled by the row and query scales,
    // written (first pass) or added (second) to the partial-score buffer of its half.
    auto qk_store = [&](const float (&acc)[MW][NT][4], int buf, bool rope, bool add) {
        float* S = Sbuf + qk_half * C::HG * C::SS;
        const float* rowscale = (rope ? rs_s : ls_s) + buf * BN;
        const int which = rope ? 1 : 0;
#pragma unroll
        for (int m = 0; m < MW; ++m) {
            const int ha = (m_first + m) * 16 + g, hb = ha + 8;
            const float mula = qm_s[ha * 2 + which], mulb = qm_s[hb * 2 + which];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int r = n0 + n * 8 + 2 * t4;
                const float s0 = rowscale[r], s1 = rowscale[r + 1];
                float2* pa = (float2*)(S + ha * C::SS + r);
                float2* pb = (float2*)(S + hb * C::SS + r);
                float2 va = make_float2(acc[m][n][0] * s0 * mula, acc[m][n][1] * s1 * mula);
                float2 vb = make_float2(acc[m][n][2] * s0 * mulb, acc[m][n][3] * s1 * mulb);
                if (add) {
                    const float2 oa = *pa, ob = *pb;
                    va.x += oa.x; va.y += oa.y;
                    vb.x += ob.x; vb.y += ob.y;
                }
                *pa = va;
                *pb = vb;
            }
        }
    };

    auto qk = [&](int buf) {
        // one warp with 16 heads has only two mma chains per pass: split them over even / odd blocks
        constexpr bool SPLIT = MT == 1;
        const u32 tb = t_base + buf * C::TILE;
        float acc[MW][NT][4], acc2[MW][NT][4];
        auto zero = [&]() {
#pragma unroll
            for (int m = 0; m < MW; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[m][n][e] = 0.0f;
                        if (SPLIT) acc2[m][n][e] = 0.0f;
                    }
        };
        auto join = [&]() {
            if (SPLIT)
#pragma unroll
                for (int m = 0; m < MW; ++m)
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[m][n][e] += acc2[m][n][e];
        };
        // this lane's ldmatrix address of swizzled chunk 2k (+ its matrix's chunk) of its row
        u32 lat_cb[4], rope_cb[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            lat_cb[k] = tb + lat_at(bq_row, 2 * k + bq_blk);
            rope_cb[k] = tb + rope_at(bq_row, (2 * k + bq_blk) & (C::RBK - 1));
        }
        zero();
        // WIDE: the rows 16 further, a ring stage's 16 latent / rope rows on
        constexpr u32 LSTEP = 16 * C::KB, RSTEP = 16 * C::RB;
        if (qk_half == 0) {
            qk_blocks_v2<C::LB0, MW, NT, FMT, C::QS>(0, 0, lat_cb, LSTEP, q_base, m_first, a_row, a_col, lt, acc,
                                                     SPLIT ? acc2 : acc);
            join();
            qk_store(acc, buf, false, false);
        } else {
            qk_blocks_v2<C::RBK, MW, NT, FMT, C::QS>(C::LB, 0, rope_cb, RSTEP, q_base, m_first, a_row, a_col, lt, acc,
                                                     SPLIT ? acc2 : acc);
            join();
            qk_store(acc, buf, true, false);
            zero();
            qk_blocks_v2<C::LB - C::LB0, MW, NT, FMT, C::QS>(C::LB0, C::LB0, lat_cb, LSTEP, q_base, m_first, a_row,
                                                             a_col, lt, acc, SPLIT ? acc2 : acc);
            join();
            qk_store(acc, buf, false, true);
        }
    };

    // rare path: clear the tile's fp8 NaN codes (0x7F / 0xFF read as 0) in place
    auto clear_nan = [&](int buf) {
        unsigned char* tb = smem + C::OFF_T + buf * C::TILE;
        for (int c = tid; c < C::TILE / 16; c += THREADS) {
            uint4* p = (uint4*)(tb + c * 16);
            uint4 v = *p;
            v.x = fp8_clear_nan(v.x);
            v.y = fp8_clear_nan(v.y);
            v.z = fp8_clear_nan(v.z);
            v.w = fp8_clear_nan(v.w);
            *p = v;
        }
    };

    // O += P' V for tile `buf` (B fragments converted from code bytes)
    auto pv = [&](int buf) {
        const u32 tb = t_base + buf * C::TILE;
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            u32 pf[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
                ldsm_x4(p_base + ((m * 16 + a_row) * C::PS + ks * 16 + a_col) * 2, pf[m][0], pf[m][1], pf[m][2],
                        pf[m][3]);
            u32 bf[C::NTP][2];
            if (FMT == 0) {
                // per 32 dims: matrices (rows 0-7, dims 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31);
                // n-tile 4 jb + 2 sub (+1) holds dims d0 + 32 jb + 16 sub + 2 n (+1)
#pragma unroll
                for (int jb = 0; jb < C::DW / 32; ++jb) {
                    u32 v[4];
                    ldsm_x4_trans(tb + lat_at(ks * 16 + bv_row, (d0 + 32 * jb + bv_col) >> 4), v[0], v[1], v[2], v[3]);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const int sub = q >> 1, half = q & 1;
                        const u32 pr = prmt(v[q], 0u, 0x3120u);  // (r, 2n) (r+1, 2n) | (r, 2n+1) (r+1, 2n+1)
                        bf[4 * jb + 2 * sub][half] = e4m3_lo_to_f16x2(pr);
                        bf[4 * jb + 2 * sub + 1][half] = e4m3_hi_to_f16x2(pr);
                    }
                }
            } else {
                // 64 dims = 32 bytes: matrices (rows 0-7, dims 0-31), (8-15, 0-31), (0-7, 32-63), (8-15, 32-63);
                // n-tile 4 jb + j holds dims d0 + 32 jb + 4 n + j
                u32 v[4];
                ldsm_x4_trans(tb + lat_at(ks * 16 + bv_row, (d0 / 2 + bv_col) >> 4), v[0], v[1], v[2], v[3]);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int jb = q >> 1, half = q & 1;
                    u32 h[4];
                    int4x8_to_f16(v[q], lt, h);
                    bf[4 * jb + 0][half] = prmt(h[0], h[2], 0x5410u);
                    bf[4 * jb + 1][half] = prmt(h[0], h[2], 0x7632u);
                    bf[4 * jb + 2][half] = prmt(h[1], h[3], 0x5410u);
                    bf[4 * jb + 3][half] = prmt(h[1], h[3], 0x7632u);
                }
            }
#pragma unroll
            for (int n = 0; n < C::NTP; ++n)
#pragma unroll
                for (int m = 0; m < MT; ++m) mma_16816(o_acc[m][n], pf[m], bf[n][0], bf[n][1]);
        }
    };

    for (int blk = blk0; blk < blk1; ++blk) {
        const int buf = (blk - blk0) & 1;
        cp_async_wait_all();

        __syncthreads();  // tile `blk` visible; every warp is done with the previous tile
        if (blk + 1 < blk1) issue(blk + 1, buf ^ 1);

        // fp8 NaN codes (0x7F / 0xFF read as 0) are not cleared on the fast path: a NaN score
        // shows in the softmax, which flags the tile; after the softmax's barrier the block undoes
        // the softmax step, clears the tile's NaN codes and scores it again (rare path).
        bool rescale;
#pragma unroll 1
        for (int attempt = 0;; ++attempt) {
            // ---- S = Q K^T -----------------------------------------------------------------------
            qk(buf);
            __syncthreads();  // scores written

            // ---- online softmax (as v1); c = running max |row scale|; thread sm_p of a head owns
            // rows sm_p * RPT .. + RPT - 1 (vector loads / stores) ---------------------------------
            const float m_prev = m_run, l_prev = l_run, c_prev = c_run;
            {
                const int r0 = sm_p * C::RPT;
                const float* lsb = ls_s + buf * BN + r0;
                const int* vb = valid_s + buf * BN + r0;
                const float* S0 = Sbuf + sm_h * C::SS + r0;
                const float* S1 = Sbuf + C::HG * C::SS + sm_h * C::SS + r0;
                float sv[C::RPT], lv[C::RPT];
                bool nan_seen = false;
                float c_blk = 0.0f, mx = NEG_INF;
#pragma unroll
                for (int i = 0; i < C::RPT; i += 4) {
                    const float4 a = *(const float4*)(S0 + i), c = *(const float4*)(S1 + i);
                    const float4 l = *(const float4*)(lsb + i);
                    const int4 v = *(const int4*)(vb + i);
                    sv[i] = v.x ? a.x + c.x : NEG_INF;
                    sv[i + 1] = v.y ? a.y + c.y : NEG_INF;
                    sv[i + 2] = v.z ? a.z + c.z : NEG_INF;
                    sv[i + 3] = v.w ? a.w + c.w : NEG_INF;
                    if (FMT == 0)
                        nan_seen |= (sv[i] != sv[i]) | (sv[i + 1] != sv[i + 1]) | (sv[i + 2] != sv[i + 2]) |
                                    (sv[i + 3] != sv[i + 3]);
                    lv[i] = l.x;
                    lv[i + 1] = l.y;
                    lv[i + 2] = l.z;
                    lv[i + 3] = l.w;
                }
#pragma unroll
                for (int i = 0; i < C::RPT; ++i) {
                    c_blk = fmaxf(c_blk, fabsf(lv[i]));
                    mx = fmaxf(mx, sv[i]);
                }
#pragma unroll
                for (int o = C::TPH / 2; o > 0; o >>= 1) {
                    c_blk = fmaxf(c_blk, __shfl_xor_sync(FULL_MASK, c_blk, o));
                    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
                }
                const float c_new = fmaxf(c_run, c_blk);
                const float c_eff = c_new > 0.0f ? c_new : 1.0f;
                const float p_mul = __fdividef(P_SCALE, c_eff);
                const float c_ratio = c_run > 0.0f ? __fdividef(c_run, c_eff) : 1.0f;
                const float m_new = fmaxf(m_run, mx);
                const float ref = m_new == NEG_INF ? 0.0f : m_new;
                const float alpha = ex2_fast(m_run - ref);
                float lsum = 0.0f;
#pragma unroll
                for (int i = 0; i < C::RPT; i += 4) {
                    u32 h[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float p = ex2_fast(sv[i + e] - ref);
                        lsum += p;
                        h[e] = f32_to_f16(p * lv[i + e] * p_mul);
                    }
                    *(uint2*)(Ps + sm_h * C::PS + r0 + i) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
                }
                l_run = l_run * alpha + lsum;
                m_run = m_new;
                const float factor = alpha * c_ratio;
                if (sm_p == 0) alpha_s[sm_h] = factor;
                c_run = c_new;
                if (nan_seen) *nan_s = blk + 1;  // names the tile: a stale flag never matches
                rescale = __syncthreads_or(factor != 1.0f) != 0;
            }
            if (FMT == 1 || attempt > 0 || *nan_s != blk + 1) break;
            m_run = m_prev;  // rare path: undo this step, clear the tile's NaN codes, score it again
            l_run = l_prev;
            c_run = c_prev;
            clear_nan(buf);  // (every thread is past the softmax: the scores and weights are free)
            __syncthreads();
        }

        // ---- O = alpha O + P' V (B fragments converted from code bytes) ----------------------
        {
            if (rescale) {
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const float aa = alpha_s[m * 16 + g], ab = alpha_s[m * 16 + g + 8];
#pragma unroll
                    for (int n = 0; n < C::NTP; ++n) {
                        o_acc[m][n][0] *= aa;
                        o_acc[m][n][1] *= aa;
                        o_acc[m][n][2] *= ab;
                        o_acc[m][n][3] *= ab;
                    }
                }
            }
            pv(buf);
        }
    }

    // ---- epilogue: normalized partial context (un-rotated for int4) and its log-sum-exp -----
    float fac[MT][2];
    const float c_fin = c_run > 0.0f ? c_run : 1.0f;
    const float vs = FMT == 1 ? rsqrtf((float)K) : 1.0f;
#pragma unroll
    for (int o = C::TPH / 2; o > 0; o >>= 1) l_run += __shfl_xor_sync(FULL_MASK, l_run, o);
    if (sm_p == 0) {
        ml_s[sm_h * 2] = m_run;
        ml_s[sm_h * 2 + 1] = l_run;
    }
    __syncthreads();  // ml_s visible; every warp is done with the tiles (ctx overlays them)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const float la = ml_s[(m * 16 + g) * 2 + 1], lb = ml_s[(m * 16 + g + 8) * 2 + 1];
        fac[m][0] = la > 0.0f ? c_fin / (P_SCALE * la) * vs : 0.0f;
        fac[m][1] = lb > 0.0f ? c_fin / (P_SCALE * lb) * vs : 0.0f;
    }
    const float lse_val = l_run > 0.0f ? m_run + log2f(l_run) : NEG_INF;
    __syncthreads();  // ml_s read before ctx overwrites it
    if (sm_p == 0) lse_out[(long long)sm_h * n_splits] = lse_val;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        float* ca = ctx + (m * 16 + g) * C::CS;
        float* cb = ca + 8 * C::CS;
        const float fa = fac[m][0], fb = fac[m][1];
        if (FMT == 0) {
#pragma unroll
            for (int n2 = 0; n2 < C::NTP / 2; ++n2) {
                const int d = d0 + 16 * n2 + 4 * t4;
                const float* x = o_acc[m][2 * n2];
                const float* y = o_acc[m][2 * n2 + 1];
                *(float4*)(ca + d) = make_float4(x[0] * fa, y[0] * fa, x[1] * fa, y[1] * fa);
                *(float4*)(cb + d) = make_float4(x[2] * fb, y[2] * fb, x[3] * fb, y[3] * fb);
            }
        } else {
#pragma unroll
            for (int jb = 0; jb < C::NTP / 4; ++jb) {
                const int d = d0 + 32 * jb + 8 * t4;
                const float* n0v = o_acc[m][4 * jb];
                const float* n1v = o_acc[m][4 * jb + 1];
                const float* n2v = o_acc[m][4 * jb + 2];
                const float* n3v = o_acc[m][4 * jb + 3];
                *(float4*)(ca + d) = make_float4(n0v[0] * fa, n1v[0] * fa, n2v[0] * fa, n3v[0] * fa);
                *(float4*)(ca + d + 4) = make_float4(n0v[1] * fa, n1v[1] * fa, n2v[1] * fa, n3v[1] * fa);
                *(float4*)(cb + d) = make_float4(n0v[2] * fb, n1v[2] * fb, n2v[2] * fb, n3v[2] * fb);
                *(float4*)(cb + d + 4) = make_float4(n0v[3] * fb, n1v[3] * fb, n2v[3] * fb, n3v[3] * fb);
            }
        }
    }
    __syncthreads();
    for (int hl = warp; hl < C::HG; hl += WARPS) {
        float v[16];
        const float* row = ctx + hl * C::CS;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 x = *(const float4*)(row + 128 * j + 4 * lane);
            v[4 * j] = x.x;
            v[4 * j + 1] = x.y;
            v[4 * j + 2] = x.z;
            v[4 * j + 3] = x.w;
        }
        if (FMT == 1) {
            fwht_warp<16>(v, lane, 1.0f / sqrtf((float)K));
#pragma unroll
            for (int j = 0; j < 16; ++j) v[j] *= tq_sign((u32)(128 * (j >> 2) + 4 * lane + (j & 3)));
        }
        // f16 with a power-of-two scale per (split, head): the largest |value| lands in [2^14, 2^15),
        // so nothing overflows and every element keeps f16's 11 bits relative to that maximum
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(v[j]));
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        const int e = amax > 0.0f ? ((__float_as_int(amax) >> 23) & 0xFF) - 127 : 0;  // amax in [2^e, 2^(e+1))
        const int up = min(max(14 - e, -126), 126);
        const float mul = __int_as_float((127 + up) << 23);
        const long long slot = ((long long)b * Hp + h0 + hl) * n_splits + split;
        u16* dst = o_part + slot * K;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *(uint2*)(dst + 128 * j + 4 * lane) =
                make_uint2(f32_to_f16(v[4 * j] * mul) | ((u32)f32_to_f16(v[4 * j + 1] * mul) << 16),
                           f32_to_f16(v[4 * j + 2] * mul) | ((u32)f32_to_f16(v[4 * j + 3] * mul) << 16));
        if (lane == 0) o_scale[slot] = __int_as_float((127 - up) << 23);  // 2^-up
    }
}

// One block per (head, CW-dim chunk, sequence), over the sequence's first n_live[b] splits (the
// others are empty). The host picks CW so the grid fills the GPU without waves of blocks that each
// do little: 32 dims for a lone 16-head sequence (256 blocks), wider for batches. The f16 partials
// (times their scale) are read 4 dims per lane: LPS lanes cover a chunk, SPP splits per warp pass,
// DG 128-dim groups per lane; warps take every 8th pass, so each has several loads in flight.
template <int K, int CW>
__global__ void __launch_bounds__(256) mla_merge_v2(const u16* __restrict__ o_part, const float* __restrict__ o_scale,
                                                    const float* __restrict__ lse_part, const int* __restrict__ n_live,
                                                    int H, int Hp, int n_splits, float* __restrict__ out) {
    constexpr int LPS = CW / 4 < 32 ? CW / 4 : 32;
    constexpr int SPP = 32 / LPS;
    constexpr int DG = CW / (4 * LPS);
    static_assert(CW % 32 == 0 && K % CW == 0 && (CW <= 128 || CW % 128 == 0), "merge chunk width");
    extern __shared__ float weights[];  // [n_splits]
    __shared__ float4 part[8][CW / 4];
    __shared__ float red[8];
    const int h = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long hb = (long long)b * Hp + h;
    const int live_splits = min(max(n_live[b], 0), n_splits);
    const float inv = lse_merge_weights(lse_part + hb * n_splits, live_splits, weights, red);
    const float* scale = o_scale + hb * n_splits;
    const int sub = lane / LPS, li = lane % LPS;
    const uint2* op = (const uint2*)(o_part + hb * n_splits * K + chunk * CW) + li;
    float4 acc[DG];
#pragma unroll
    for (int j = 0; j < DG; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int s = warp * SPP + sub; s < live_splits; s += 8 * SPP) {
        const float w = weights[s];
        const bool live = w > 0.0f;  // a split whose rows all scored -inf wrote neither partial nor scale
        const float ws = live ? w * scale[s] : 0.0f;
#pragma unroll
        for (int j = 0; j < DG; ++j) {
            const uint2 v = live ? op[(long long)s * (K / 4) + 32 * j] : make_uint2(0u, 0u);
            const float2 lo = f16x2_to_f32x2(v.x), hi = f16x2_to_f32x2(v.y);
            acc[j].x += live ? ws * lo.x : 0.0f;
            acc[j].y += live ? ws * lo.y : 0.0f;
            acc[j].z += live ? ws * hi.x : 0.0f;
            acc[j].w += live ? ws * hi.y : 0.0f;
        }
    }
#pragma unroll
    for (int o = LPS; o < 32; o <<= 1)
#pragma unroll
        for (int j = 0; j < DG; ++j) {
            acc[j].x += __shfl_xor_sync(FULL_MASK, acc[j].x, o);
            acc[j].y += __shfl_xor_sync(FULL_MASK, acc[j].y, o);
            acc[j].z += __shfl_xor_sync(FULL_MASK, acc[j].z, o);
            acc[j].w += __shfl_xor_sync(FULL_MASK, acc[j].w, o);
        }
    if (sub == 0)
#pragma unroll
        for (int j = 0; j < DG; ++j) part[warp][li + 32 * j] = acc[j];
    __syncthreads();
    for (int i = tid; i < CW / 4; i += 256) {
        float4 sum = part[0][i];
#pragma unroll
        for (int w = 1; w < 8; ++w) {
            sum.x += part[w][i].x;
            sum.y += part[w][i].y;
            sum.z += part[w][i].z;
            sum.w += part[w][i].w;
        }
        ((float4*)(out + ((long long)b * H + h) * K + chunk * CW))[i] =
            make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv);
    }
}
