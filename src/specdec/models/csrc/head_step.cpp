// The EAGLE head's decode step on the CPU in one C++ call: the same ATen operations, in the same
// order and on the same views, as the Python path of `HeadGraphs.forward` / `_decode_step`
// (`EagleHead.project_features` through `FeatureNorm`'s float path and `fc`,
// `EagleHead.forward_decode` with `fused.add_rms_norm_ref`, `fused.rope_write_kv_ref`,
// `fused.paged_decode_attention_ref`, `fused.silu_mul_ref`, and `QuantizedWeight.matmul` for the
// cpu_int8 layout), so its head outputs and K/V are the Python path's bit for bit; only the
// interpreter's work between the operations is gone. `drafters/eagle/head_native.py` decides
// which heads it runs (ours, float32, int8 linears, no window or tree) and calls it; registered
// as `torch.ops.specdec_eagle.head_step` (a fragment: the extension's module stays its own).

#include <torch/extension.h>

#include <limits>
#include <optional>
#include <vector>

using at::Tensor;

namespace {

// QuantizedWeight.matmul, cpu_int8 layout: x in bfloat16, the result back in x's dtype.
Tensor int8_linear(const Tensor& x, const Tensor& values, const Tensor& scale) {
  Tensor xk = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  Tensor out = at::_weight_int8pack_mm(xk, values, scale);
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

// fused.add_rms_norm_ref's normed output for float32 x and weight, no residual.
Tensor rms(const Tensor& x, const Tensor& weight, double eps) {
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

// fused.rope_write_kv_ref's `rotate`: "rotate half" in float32, back in `dtype`.
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, at::ScalarType dtype) {
  auto halves = x.to(at::kFloat).chunk(2, -1);
  const Tensor& first = halves[0];
  const Tensor& second = halves[1];
  Tensor out = at::cat({first * cos - second * sin, second * cos + first * sin}, -1);
  return out.to(dtype);
}

// fused.paged_decode_attention_ref without window, score cap or tree mask.
Tensor decode_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& tables, const Tensor& context_lens,
                        const Tensor& query_lens, int64_t q_per_seq, double scale) {
  const int64_t num_seqs = context_lens.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  Tensor out = at::zeros_like(query);
  const Tensor ctx_host = context_lens.to(at::kLong).contiguous();
  const Tensor qlen_host = query_lens.to(at::kLong).contiguous();
  const int64_t* ctxs = ctx_host.data_ptr<int64_t>();
  const int64_t* qlens = qlen_host.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t ctx = ctxs[b];
    if (ctx == 0) continue;
    const int64_t num_blocks = (ctx + block_size - 1) / block_size;
    Tensor blocks = tables.select(0, b).slice(0, 0, num_blocks).to(at::kLong);
    Tensor keys = k_cache.index({blocks}).flatten(0, 1).slice(0, 0, ctx).to(at::kFloat);
    Tensor values = v_cache.index({blocks}).flatten(0, 1).slice(0, 0, ctx).to(at::kFloat);
    Tensor rows = query.slice(0, b * q_per_seq, (b + 1) * q_per_seq).to(at::kFloat);
    const int64_t group = num_heads / num_kv_heads;
    keys = keys.repeat_interleave(group, 1);
    values = values.repeat_interleave(group, 1);
    Tensor scores = at::einsum("qhd,shd->hqs", {rows, keys}) * scale;
    Tensor query_pos = (ctx - qlens[b]) + at::arange(q_per_seq, query.options().dtype(at::kLong));
    Tensor visible = at::arange(ctx, query.options().dtype(at::kLong)).unsqueeze(0) <=
                     query_pos.unsqueeze(1);
    scores = scores.masked_fill(visible.unsqueeze(0).bitwise_not(),
                                -std::numeric_limits<double>::infinity());
    Tensor weights = scores.softmax(-1);
    out.slice(0, b * q_per_seq, (b + 1) * q_per_seq)
        .copy_(at::einsum("hqs,shd->qhd", {weights, values}).to(query.scalar_type()));
  }
  return out;
}

// One step of head entries: `input` is [R, F] target features (`project`: through the feature
// norm and fc first) or [R, D] hidden inputs; `embeds` [R, D] the tokens' embeddings;
// `positions`, `slots` [R]; `context_lens`, `query_lens` [S]; `tables` [S, max_blocks]
// (DecodeMetadata with query_per_seq `width`); `ends` [S] rows to return (None: all rows).
// `weights`: feature norm, fc values and scale, embed norm, hidden norm, in_proj values and
// scale, input norm, qkv values and scale, o values and scale, post-attention norm, gate_up
// values and scale, down values and scale, RoPE inverse frequencies (18 tensors); `eps`: of the
// feature, embed, hidden, input and post-attention norms. `k_cache`/`v_cache`: the head's one
// layer [num_blocks, block_size, H_kv, D_head]. Writes the entries' K/V; returns [R or S, D].
Tensor head_step(const Tensor& input, bool project, const Tensor& embeds_in,
                 const Tensor& positions, const Tensor& slot_mapping,
                 const Tensor& context_lens, const Tensor& query_lens, const Tensor& tables,
                 int64_t width, const std::optional<Tensor>& ends, const Tensor& k_cache,
                 const Tensor& v_cache, at::TensorList weights,
                 at::ArrayRef<double> eps, int64_t num_parts, int64_t num_heads,
                 int64_t num_kv_heads, double scale) {
  TORCH_CHECK(weights.size() == 18 && eps.size() == 5, "head_step: 18 weights, 5 epsilons");
  at::NoGradGuard no_grad;
  const Tensor* w = weights.data();  // (ArrayRef: contiguous)
  Tensor hidden = input;
  if (project) {  // EagleHead.project_features: FeatureNorm (float path), then fc
    const auto shape = input.sizes().vec();
    const int64_t dim = shape.back() / num_parts;
    std::vector<int64_t> parts(shape.begin(), shape.end() - 1);
    parts.push_back(num_parts);
    parts.push_back(dim);
    Tensor x = input.to(at::kFloat).view(parts);
    x = x * at::rsqrt(x.pow(2).mean(-1, true) + eps[0]);
    Tensor normed = w[0] * x.view(shape).to(input.scalar_type());
    hidden = int8_linear(normed, w[1], w[2]);
  }
  // EagleHead.forward_decode
  Tensor embeds = rms(embeds_in, w[3], eps[1]);
  hidden = rms(hidden, w[4], eps[2]);
  Tensor x = int8_linear(at::cat({embeds, hidden}, -1), w[5], w[6]);
  Tensor normed = rms(x, w[7], eps[3]);
  Tensor residual = x;
  // LlamaAttention.forward_decode (no plan): qkv, fused.rope_write_kv_ref, the attention, o
  Tensor qkv = int8_linear(normed, w[8], w[9]);
  const int64_t num_tokens = qkv.size(0);
  const int64_t head_dim = k_cache.size(-1);
  Tensor heads = qkv.view({num_tokens, num_heads + 2 * num_kv_heads, head_dim});
  Tensor freqs = positions.unsqueeze(1).to(at::kFloat) * w[17].to(at::kFloat);
  Tensor cos = freqs.cos().unsqueeze(1), sin = freqs.sin().unsqueeze(1);
  Tensor query = rotate(heads.slice(1, 0, num_heads), cos, sin, qkv.scalar_type());
  Tensor key = rotate(heads.slice(1, num_heads, num_heads + num_kv_heads), cos, sin,
                      qkv.scalar_type());
  Tensor value = heads.slice(1, num_heads + num_kv_heads);
  Tensor keep = slot_mapping >= 0;
  Tensor slots = slot_mapping.index({keep});
  k_cache.view({-1, num_kv_heads, head_dim})
      .index_put_({slots}, key.index({keep}).to(k_cache.scalar_type()));
  v_cache.view({-1, num_kv_heads, head_dim})
      .index_put_({slots}, value.index({keep}).to(v_cache.scalar_type()));
  Tensor attended =
      decode_attention(query, k_cache, v_cache, tables, context_lens, query_lens, width, scale);
  Tensor out = int8_linear(attended.reshape({num_tokens, num_heads * head_dim}), w[10], w[11]);
  // the post-attention add + norm, the MLP (silu_mul_ref), the residual
  Tensor summed = out + residual;
  normed = rms(summed, w[12], eps[4]);
  Tensor gate_up = int8_linear(normed, w[13], w[14]);
  auto halves = gate_up.chunk(2, -1);
  Tensor gated = at::silu(halves[0]) * halves[1];
  out = int8_linear(gated, w[15], w[16]) + summed;
  return ends.has_value() ? out.index_select(0, *ends) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_eagle, m) {
  m.def(
      "head_step(Tensor input, bool project, Tensor embeds, Tensor positions, Tensor slots, "
      "Tensor context_lens, Tensor query_lens, Tensor tables, int width, Tensor? ends, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor[] weights, float[] eps, int num_parts, "
      "int num_heads, int num_kv_heads, float scale) -> Tensor");
  m.impl("head_step", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(head_step));
}
