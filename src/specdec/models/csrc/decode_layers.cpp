// The CPU decode step's decoder layers in one C++ call: the same ATen operations, in the same
// order and on the same views, as the Python loop of `LlamaModel._forward_decode` over
// `LlamaDecoderLayer.forward_decode` with a `DecodePlanCPU` (`decode_cpu.rope_write_kv_cpu`,
// `decode_cpu.decode_attention_cpu`, `fused.add_rms_norm_ref`, `fused.silu_mul_ref`,
// `QuantizedWeight.matmul` for the cpu_int4 layout), so its results are the Python loop's bit
// for bit; only the interpreter's work between the operations is gone. Attention takes
// `row_attention` (below) in both loops: each query row over its own keys in arithmetic of its
// own (SDPA, one call per row, spent more time than the products on ~1,000-token prompts). Built and loaded by
// `models/cpu_extension.py`; `models/decode_cpu_native.py` decides which models the loop runs.

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

using at::Tensor;

namespace {

// QuantizedWeight.matmul, cpu_int4 layout: x in bfloat16, expanded when the source is 8-bit
// ([x_g, 16 x_g] per source group: quant.expand_input), the result back in x's dtype.
Tensor int4_linear(const Tensor& x, const Tensor& packed, const Tensor& scale_zero,
                   int64_t group, int64_t source_group) {
  Tensor xk = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  if (source_group > 0) {
    const int64_t rows = xk.size(0), cols = xk.size(1);
    Tensor grouped = xk.view({rows, cols / source_group, 1, source_group});
    xk = at::cat({grouped, grouped * 16}, 2).view({rows, 2 * cols});
  }
  Tensor out = at::_weight_int4pack_mm_for_cpu(xk, packed, group, scale_zero);
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

// fused.add_rms_norm_ref for float32 activations and weight: (norm(x + residual), x + residual).
std::pair<Tensor, Tensor> add_norm(const Tensor& x, const std::optional<Tensor>& residual,
                                   const Tensor& weight, double eps) {
  Tensor summed = residual.has_value() ? x + *residual : x;
  return {at::rms_norm(summed, {summed.size(-1)}, weight, eps), summed};
}

}  // namespace

// q8_linear's and row_attention's last reduction: 16 lanes summed pairwise (l + 8, then + 4,
// + 2, + 1).
static inline float lanes_finish(const float* lanes) {
  float v8[8], v4[4];
  for (int l = 0; l < 8; ++l) v8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) v4[l] = v8[l] + v8[l + 4];
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// exp(x) for x <= 0 (x below -87 taken as -87), in float32 products and sums only (Cephes'
// expf: n = round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln 2 in two parts, a degree-7
// polynomial, times 2^n built from its bits), so that `cpu_extension.exp_nonpositive_ref`
// repeats it bit for bit with PyTorch operations. Within 2 ulp of exp.
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// One query row of attention over its keys, the same arithmetic for every row whatever else
// the step holds (`cpu_extension.row_attention_ref` repeats it with PyTorch operations):
// per key s and query head, 16 lanes l summing q[c * 16 + l] * k[c * 16 + l] over the
// head's 16-wide chunks c in order, finished pairwise (`lanes_finish`), times `scale`;
// p[s] = exp_nonpositive(score[s] - max score); the p summed over 16 lanes (lane s % 16, in
// key order) finished pairwise into l; out[d] = (sum over s in key order of p[s] v[s][d]) / l.
// A GQA group's query heads share each key's loads; every head keeps its own sums.
struct RowJob {
  int64_t row;       // the query row (of `query` and `out`)
  const float* k;    // its first key: [count, H_kv, D] rows of stride H_kv * D
  const float* v;
  int64_t count;     // keys it sees
};

static void attend_row(const RowJob& job, int64_t kv_head, const float* query,
                       int64_t q_row_stride, int64_t q_head_stride, float* out,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                       std::vector<float>& scores) {
  const int64_t group = num_heads / num_kv_heads, count = job.count;
  const int64_t key_stride = num_kv_heads * head_dim, chunks = head_dim / 16;
  const int64_t first_head = kv_head * group;
  scores.resize(group * count);
  for (int64_t s = 0; s < count; ++s) {
    const float* k = job.k + s * key_stride + kv_head * head_dim;
    for (int64_t i = 0; i < group; ++i) {
      const float* q = query + job.row * q_row_stride + (first_head + i) * q_head_stride;
      float lanes[16] = {0};
      for (int64_t c = 0; c < chunks; ++c) {
        for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + q[c * 16 + l] * k[c * 16 + l];
      }
      scores[i * count + s] = lanes_finish(lanes) * scale;
    }
  }
  for (int64_t i = 0; i < group; ++i) {
    float* p = scores.data() + i * count;
    float top = p[0];
    for (int64_t s = 1; s < count; ++s) top = p[s] > top ? p[s] : top;
    float lanes[16] = {0};
    int64_t s = 0;
    for (; s + 16 <= count; s += 16) {
      for (int l = 0; l < 16; ++l) {
        p[s + l] = exp_nonpositive(p[s + l] - top);
        lanes[l] = lanes[l] + p[s + l];
      }
    }
    for (int l = 0; s + l < count; ++l) {
      p[s + l] = exp_nonpositive(p[s + l] - top);
      lanes[l] = lanes[l] + p[s + l];
    }
    const float total = lanes_finish(lanes);
    float* o = out + job.row * num_heads * head_dim + (first_head + i) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    for (int64_t s2 = 0; s2 < count; ++s2) {
      const float* v = job.v + s2 * key_stride + kv_head * head_dim;
      const float w = p[s2];
      for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] + w * v[d];
    }
    for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] / total;
  }
}

// Every job's row, for every KV head, into `out` ([T, H_q, D] float32 contiguous; rows
// without a job untouched): one (row, KV head) per work item, spread over PyTorch's intra-op
// threads (OpenMP); a row's values never depend on the split, the other jobs or their number.
static void attend_rows(const std::vector<RowJob>& jobs, const Tensor& query, Tensor& out,
                        int64_t num_kv_heads, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.stride(2) == 1, "query: [T, H, D] f32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "out: [T, H, D] f32");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && num_heads % num_kv_heads == 0, "D % 16, H_q % H_kv");
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t items = static_cast<int64_t>(jobs.size()) * num_kv_heads;
  const float fscale = static_cast<float>(scale);
  int64_t work = 0;
  for (const RowJob& job : jobs) work += job.count;
  const int workers = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work * num_heads / 4096)));
#pragma omp parallel num_threads(workers)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < items; ++item) {
      attend_row(jobs[item / num_kv_heads], item % num_kv_heads, q, q_row, q_head, o,
                 num_heads, num_kv_heads, head_dim, fscale, scores);
    }
  }
}

// Python's entry (`cpu_extension.row_attention`): per sequence s its keys and values
// ([S_s, H_kv, D] float32 contiguous) and its rows row_starts[offsets[s] .. offsets[s+1])
// (query rows first_rows[s] + j, each seeing keys [begins[j], ends[j])). Writes `out`.
void row_attention(const Tensor& query, const std::vector<Tensor>& keys,
                   const std::vector<Tensor>& values, const std::vector<int64_t>& first_rows,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& begins,
                   const std::vector<int64_t>& ends, double scale, Tensor out) {
  std::vector<RowJob> jobs;
  jobs.reserve(begins.size());
  const int64_t num_kv_heads = keys.empty() ? 1 : keys[0].size(1);
  for (size_t s = 0; s < keys.size(); ++s) {
    TORCH_CHECK(keys[s].scalar_type() == at::kFloat && keys[s].is_contiguous() &&
                    values[s].scalar_type() == at::kFloat && values[s].is_contiguous() &&
                    keys[s].sizes() == values[s].sizes() && keys[s].size(1) == num_kv_heads,
                "keys, values: [S, H_kv, D] float32 contiguous");
    const float* k = keys[s].data_ptr<float>();
    const float* v = values[s].data_ptr<float>();
    const int64_t stride = keys[s].size(1) * keys[s].size(2);
    for (int64_t j = offsets[s]; j < offsets[s + 1]; ++j) {
      TORCH_CHECK(0 <= begins[j] && begins[j] < ends[j] && ends[j] <= keys[s].size(0),
                  "a row's keys out of its sequence's");
      jobs.push_back({first_rows[s] + (j - offsets[s]), k + begins[j] * stride,
                      v + begins[j] * stride, ends[j] - begins[j]});
    }
  }
  attend_rows(jobs, query, out, num_kv_heads, scale);
}

// Runs every decoder layer. `weights`: per layer input-norm weight, post-attention-norm weight,
// then (packed, scale_zero) of qkv_proj, o_proj, gate_up_proj and down_proj (10 tensors);
// `meta`: per layer and linear (group size, source group or 0), 8 integers. The plan: `cos`,
// `sin`, `half_swap`, `slots`, `write_rows` as in `DecodePlanCPU`; its sequences as first rows,
// key counts (flattened, with offsets), the first slot of consecutive keys or -1 with the
// gathered slots in `key_slots`; `all_live`. Returns (out, residual, the residual stream after
// each layer of `wanted`).
std::tuple<Tensor, Tensor, std::vector<Tensor>> decode_layers(
    Tensor out, const std::vector<Tensor>& weights, const std::vector<int64_t>& meta,
    const Tensor& cos, const Tensor& sin, const Tensor& half_swap, const Tensor& slots,
    const std::optional<Tensor>& write_rows, const std::vector<int64_t>& first_rows,
    const std::vector<int64_t>& counts, const std::vector<int64_t>& count_offsets,
    const std::vector<int64_t>& key_starts, const std::vector<Tensor>& key_slots, bool all_live,
    const Tensor& k_cache, const Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads,
    double scale, double eps, const std::vector<int64_t>& wanted) {
  at::NoGradGuard no_grad;
  const int64_t num_layers = k_cache.size(0);
  const int64_t head_dim = k_cache.size(-1);
  const bool gqa = num_heads != num_kv_heads;
  std::optional<Tensor> residual;
  std::vector<Tensor> captured(wanted.size());
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const Tensor* w = &weights[layer * 10];
    const int64_t* m = &meta[layer * 8];
    const Tensor layer_k = k_cache.select(0, layer), layer_v = v_cache.select(0, layer);
    auto [normed, summed] = add_norm(out, residual, w[0], eps);
    residual = summed;
    // LlamaAttention.forward_decode with a plan.
    Tensor qkv = int4_linear(normed, w[2], w[3], m[0], m[1]);
    const int64_t num_tokens = qkv.size(0);
    // decode_cpu.rope_write_kv_cpu
    Tensor heads = qkv.view({num_tokens, num_heads + 2 * num_kv_heads, head_dim});
    Tensor qk = heads.slice(1, 0, num_heads + num_kv_heads);
    if (qk.scalar_type() != at::kFloat) qk = qk.to(at::kFloat);
    Tensor rotated = qk * cos + qk.index_select(-1, half_swap) * sin;
    if (rotated.scalar_type() != qkv.scalar_type()) rotated = rotated.to(qkv.scalar_type());
    Tensor key = rotated.slice(1, num_heads);
    Tensor value = heads.slice(1, num_heads + num_kv_heads);
    if (write_rows.has_value()) {
      key = key.index({*write_rows});
      value = value.index({*write_rows});
    }
    if (key.scalar_type() != layer_k.scalar_type()) {
      key = key.to(layer_k.scalar_type());
      value = value.to(layer_v.scalar_type());
    }
    Tensor flat_k = layer_k.view({-1, num_kv_heads, head_dim});
    Tensor flat_v = layer_v.view({-1, num_kv_heads, head_dim});
    flat_k.index_copy_(0, slots, key);
    flat_v.index_copy_(0, slots, value);
    Tensor query = rotated.slice(1, 0, num_heads);
    // decode_cpu.decode_attention_cpu (no window, no soft-capping): `row_attention` where it
    // takes the step (float32 queries, D a multiple of 16), else one SDPA call per row.
    const int64_t num_rows = query.size(0);
    const bool own_kernel = query.scalar_type() == at::kFloat && head_dim % 16 == 0;
    Tensor rows = query.transpose(0, 1).unsqueeze(0);
    std::vector<int64_t> out_rows;
    std::vector<Tensor> outputs;
    std::vector<Tensor> seq_keys, seq_values;  // kept alive while the jobs point into them
    std::vector<RowJob> jobs;
    for (size_t s = 0; s < first_rows.size(); ++s) {
      const int64_t begin = count_offsets[s], end = count_offsets[s + 1];
      const int64_t last = counts[end - 1];
      Tensor keys, values;
      if (key_starts[s] >= 0) {
        keys = flat_k.slice(0, key_starts[s], key_starts[s] + last);
        values = flat_v.slice(0, key_starts[s], key_starts[s] + last);
      } else {
        keys = flat_k.index_select(0, key_slots[s]);
        values = flat_v.index_select(0, key_slots[s]);
      }
      if (keys.scalar_type() != query.scalar_type()) {
        keys = keys.to(query.scalar_type());
        values = values.to(query.scalar_type());
      }
      if (own_kernel) {
        keys = keys.contiguous();
        values = values.contiguous();
        seq_keys.push_back(keys);
        seq_values.push_back(values);
        for (int64_t j = begin; j < end; ++j) {
          jobs.push_back({first_rows[s] + (j - begin), keys.data_ptr<float>(),
                          values.data_ptr<float>(), counts[j]});
        }
        continue;
      }
      keys = keys.transpose(0, 1).unsqueeze(0);
      values = values.transpose(0, 1).unsqueeze(0);
      for (int64_t j = begin; j < end; ++j) {
        const int64_t row = first_rows[s] + (j - begin);
        Tensor attended = at::scaled_dot_product_attention(
            rows.slice(2, row, row + 1), keys.slice(2, 0, counts[j]),
            values.slice(2, 0, counts[j]), std::nullopt, 0.0, false, scale, gqa);
        out_rows.push_back(row);
        outputs.push_back(attended.select(0, 0).select(1, 0));
      }
    }
    Tensor attention;
    if (own_kernel) {
      attention = at::zeros({num_rows, num_heads, head_dim}, query.options());
      attend_rows(jobs, query, attention, num_kv_heads, scale);
    } else if (static_cast<int64_t>(outputs.size()) == num_rows && all_live) {
      attention = at::stack(outputs);
    } else {
      attention = query.new_zeros({num_rows, num_heads, head_dim});
      for (size_t i = 0; i < outputs.size(); ++i) attention.select(0, out_rows[i]).copy_(outputs[i]);
    }
    Tensor attn_out =
        int4_linear(attention.reshape({num_tokens, num_heads * head_dim}), w[4], w[5], m[2], m[3]);
    // LlamaDecoderLayer.forward_decode: the MLP on norm(attention + residual).
    auto [normed2, summed2] = add_norm(attn_out, residual, w[1], eps);
    residual = summed2;
    Tensor gate_up = int4_linear(normed2, w[6], w[7], m[4], m[5]);
    auto halves = gate_up.chunk(2, -1);
    Tensor gated = at::silu(halves[0]) * halves[1];
    out = int4_linear(gated, w[8], w[9], m[6], m[7]);
    for (size_t i = 0; i < wanted.size(); ++i) {
      if (wanted[i] == layer) captured[i] = out + *residual;
    }
  }
  return {out, *residual, captured};
}

#if defined(__AVX512F__)
constexpr int64_t PREFETCH_ROWS = 4;  // how far ahead a row selection's rows are fetched

// q8_linear's outputs [begin, end) of `Tile` rows of x (x and out at their first row), the
// lanes of each row in one register: the arithmetic of `q8_linear`'s comment, per row.
template <int Tile>
static void q8_rows_avx512(const float* xs, const int8_t* qs, const float* ds, float* os,
                           int64_t cols, int64_t outs, int64_t groups, int64_t chunks,
                           int64_t begin, int64_t end, const int64_t* row_ids) {
  for (int64_t n = begin; n < end; ++n) {
    const int64_t w = row_ids == nullptr ? n : row_ids[n];  // output n's weight row
    if (row_ids != nullptr && n + PREFETCH_ROWS < end) {
      // Selected rows are scattered through W: fetch a later one's bytes and scales now, or
      // each row waits on memory (contiguous rows are streamed by the hardware prefetcher).
      const int64_t ahead = row_ids[n + PREFETCH_ROWS];
      const char* bytes = reinterpret_cast<const char*>(qs + ahead * cols);
      for (int64_t at = 0; at < cols; at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
      const char* scales = reinterpret_cast<const char*>(ds + ahead * groups);
      for (int64_t at = 0; at < groups * 4; at += 64) _mm_prefetch(scales + at, _MM_HINT_T0);
    }
    const int8_t* q_row = qs + w * cols;
    const float* d_row = ds + w * groups;
    __m512 acc[Tile];
    for (int t = 0; t < Tile; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sums[Tile];
      for (int t = 0; t < Tile; ++t) sums[t] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (g * chunks + c) * 16;
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q_row + at));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        for (int t = 0; t < Tile; ++t) {
          const __m512 x = _mm512_loadu_ps(xs + t * cols + at);
          sums[t] = _mm512_add_ps(sums[t], _mm512_mul_ps(x, q));
        }
      }
      const __m512 d = _mm512_set1_ps(d_row[g]);
      for (int t = 0; t < Tile; ++t) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(sums[t], d));
    }
    for (int t = 0; t < Tile; ++t) {
      float lanes[16];
      _mm512_storeu_ps(lanes, acc[t]);
      os[t * outs + n] = lanes_finish(lanes);
    }
  }
}
#endif

// x @ W^T for a symmetric 8-bit group-quantized W (GGUF Q8_0, Q6_K): W[n, k] = values[n, k] *
// scale[n, k / group], with x in float32 and a float32 result. The arithmetic, which
// `cpu_extension.q8_linear_ref` repeats with PyTorch operations, is per output (m, n) and
// never depends on M: 16 lanes; per group, s[l] = sum over the group's 16-wide chunks c, in
// order, of x[c * 16 + l] * float(values[c * 16 + l]) (a product, then a sum: built with
// -ffp-contract=off), then lanes[l] += s[l] * scale[g]; the lanes summed pairwise
// (l + 8, then + 4, + 2, + 1). One pass over W's bytes for every four rows of x. With `rows`
// ([N'] int64), output n is weight row rows[n] (a row selection read in place: an EAGLE head's
// draft vocabulary in its target's LM head), with the same sums, so the bits of a copy of them.
Tensor q8_linear(const Tensor& x_in, const Tensor& values, const Tensor& scale, int64_t group,
                 const std::optional<Tensor>& rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "x: [M, K] float32");
  TORCH_CHECK(values.scalar_type() == at::kChar && values.is_contiguous(), "values: int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: float32");
  TORCH_CHECK(group % 16 == 0 && values.size(1) % group == 0, "group: a multiple of 16");
  const Tensor x = x_in.contiguous();
  const int64_t num_rows = x.size(0), cols = x.size(1), weight_rows = values.size(0);
  TORCH_CHECK(values.size(1) == cols && scale.size(0) == weight_rows &&
                  scale.size(1) == cols / group,
              "shapes of x, values and scale disagree");
  Tensor row_index;
  const int64_t* row_ids = nullptr;
  if (rows.has_value()) {
    row_index = rows->contiguous();
    TORCH_CHECK(row_index.scalar_type() == at::kLong && row_index.dim() == 1,
                "rows: [N'] int64");
    TORCH_CHECK(row_index.numel() == 0 || (row_index.min().item<int64_t>() >= 0 &&
                                           row_index.max().item<int64_t>() < weight_rows),
                "rows: indices of W's rows");
    row_ids = row_index.data_ptr<int64_t>();
  }
  const int64_t outs = row_ids == nullptr ? weight_rows : row_index.size(0);
  Tensor out = at::empty({num_rows, outs}, x.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* qs = values.data_ptr<int8_t>();
  const float* ds = scale.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t groups = cols / group, chunks = group / 16;
#if !defined(__AVX512F__)
  // One output's lanes in `lanes` (the scalar form of the arithmetic above).
  auto one = [&](const float* x_row, int64_t n, float* lanes) {
    const int64_t w = row_ids == nullptr ? n : row_ids[n];
    const int8_t* q_row = qs + w * cols;
    const float* d_row = ds + w * groups;
    for (int l = 0; l < 16; ++l) lanes[l] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      float sums[16] = {0};
      for (int64_t c = 0; c < chunks; ++c) {
        const float* xc = x_row + (g * chunks + c) * 16;
        const int8_t* qc = q_row + (g * chunks + c) * 16;
        for (int l = 0; l < 16; ++l) sums[l] = sums[l] + xc[l] * static_cast<float>(qc[l]);
      }
      const float d = d_row[g];
      for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + sums[l] * d;
    }
  };
#endif
  auto block = [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    // The same lane arithmetic, one 16-lane register per row for its lanes (mul, then add).
    // Up to four rows of x share each weight row's load and conversion (a verify step's rows:
    // one pass over W's bytes for all of them); each row's sums stay its own.
    for (int64_t m0 = 0; m0 < num_rows; m0 += 4) {
      const float* x0 = xs + m0 * cols;
      float* o0 = os + m0 * outs;
      const int64_t* ids = row_ids;
      switch (std::min<int64_t>(4, num_rows - m0)) {
        case 4: q8_rows_avx512<4>(x0, qs, ds, o0, cols, outs, groups, chunks, begin, end, ids); break;
        case 3: q8_rows_avx512<3>(x0, qs, ds, o0, cols, outs, groups, chunks, begin, end, ids); break;
        case 2: q8_rows_avx512<2>(x0, qs, ds, o0, cols, outs, groups, chunks, begin, end, ids); break;
        default: q8_rows_avx512<1>(x0, qs, ds, o0, cols, outs, groups, chunks, begin, end, ids);
      }
    }
#else
    for (int64_t m = 0; m < num_rows; ++m) {
      const float* x_row = xs + m * cols;
      for (int64_t n = begin; n < end; ++n) {
        float lanes[16];
        one(x_row, n, lanes);
        os[m * outs + n] = lanes_finish(lanes);
      }
    }
#endif
  };
  // Outputs in contiguous ranges, one per PyTorch intra-op thread, in OpenMP (built with
  // -fopenmp: the process's one libgomp, whose pool PyTorch's kernels use too); each output is
  // computed whole by one thread, so the split never changes a bit.
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), outs / 256));
  const int64_t per = (outs + workers - 1) / workers;
#pragma omp parallel for num_threads(workers) schedule(static, 1)
  for (int64_t w = 0; w < workers; ++w) {
    block(std::min(outs, w * per), std::min(outs, (w + 1) * per));
  }
  return out;
}

// philox_rows.cpp
torch::Tensor philox_rows(const torch::Tensor& c1, const torch::Tensor& c2,
                          const torch::Tensor& c3, const torch::Tensor& k0,
                          const torch::Tensor& k1, int64_t num_blocks);
torch::Tensor philox_uniform32_rows(const torch::Tensor& c1, const torch::Tensor& c2,
                                    const torch::Tensor& c3, const torch::Tensor& k0,
                                    const torch::Tensor& k1, int64_t num_lanes);
torch::Tensor unusable_rows_f32(const torch::Tensor& logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("decode_layers", &decode_layers, "the CPU decode step's decoder layers");
  module.def("row_attention", &row_attention,
             "attention of query rows over their keys, each row's arithmetic its own");
  module.def("q8_linear", &q8_linear, "x @ W^T for a symmetric 8-bit group-quantized W",
             pybind11::arg("x"), pybind11::arg("values"), pybind11::arg("scale"),
             pybind11::arg("group"), pybind11::arg("rows") = pybind11::none());
  module.def("philox_rows", &philox_rows, "Philox4x32-10 in random_words' layout");
  module.def("philox_uniform32_rows", &philox_uniform32_rows,
             "Philox4x32-10 mapped to uniform's float32 lanes");
  module.def("unusable_rows_f32", &unusable_rows_f32,
             "rows of float32 logits with no finite value or a +inf");
}
