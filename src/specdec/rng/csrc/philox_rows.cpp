// Philox4x32-10 in `specdec.rng.draws.random_words`' layout, for the CPU: row r draws blocks
// b = 0..num_blocks-1 with counter (b, c1[r], c2[r], c3[r]) and key (k0[r], k1[r]). Integer
// arithmetic only, so the words are exactly those of `specdec.rng.philox.philox4x32_10_torch`
// (tests/unit/test_rng_native.py checks it); 32 x 32 -> 64-bit products in uint64. A full-
// vocabulary row (12,288 blocks) in about 0.07 ms, a fifth of the NumPy rounds' time. Compiled
// into the CPU extension (`specdec.models.cpu_extension`); the engine hands it to `random_words`.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;
// `specdec.rng.draws.UNIFORM32_MAX`: 1 - 2**-24, the largest float32 below 1.
constexpr float kUniform32Max = 1.0f - 0x1p-24f;
// Counter blocks per task of `philox_uniform32_rows` (a full-vocabulary row is 12,288).
constexpr int64_t kBlocksPerTask = 2048;

// The per-round keys of key (k0, k1): round i's is (k0 + i W0, k1 + i W1) mod 2**32, as
// (k + W) & MASK32 makes them.
void round_keys(int64_t k0, int64_t k1, uint32_t keys0[kRounds], uint32_t keys1[kRounds]) {
  keys0[0] = static_cast<uint32_t>(k0);
  keys1[0] = static_cast<uint32_t>(k1);
  for (int i = 1; i < kRounds; ++i) {
    keys0[i] = keys0[i - 1] + kW0;
    keys1[i] = keys1[i - 1] + kW1;
  }
}

// Block b's four words for counter (b, s1, s2, s3) under the round keys.
inline void philox_block(uint32_t b, uint32_t s1, uint32_t s2, uint32_t s3,
                         const uint32_t keys0[kRounds], const uint32_t keys1[kRounds],
                         uint32_t out[4]) {
  uint32_t x0 = b, x1 = s1, x2 = s2, x3 = s3;
  for (int i = 0; i < kRounds; ++i) {
    const uint64_t p0 = static_cast<uint64_t>(x0) * kM0;
    const uint64_t p1 = static_cast<uint64_t>(x2) * kM1;
    x0 = static_cast<uint32_t>(p1 >> 32) ^ x1 ^ keys0[i];
    x1 = static_cast<uint32_t>(p1);
    x2 = static_cast<uint32_t>(p0 >> 32) ^ x3 ^ keys1[i];
    x3 = static_cast<uint32_t>(p0);
  }
  out[0] = x0;
  out[1] = x1;
  out[2] = x2;
  out[3] = x3;
}

void check_words(const torch::Tensor& c1, const torch::Tensor& c2, const torch::Tensor& c3,
                 const torch::Tensor& k0, const torch::Tensor& k1, const char* name) {
  const int64_t rows = c1.size(0);
  for (const torch::Tensor* word : {&c1, &c2, &c3, &k0, &k1}) {
    TORCH_CHECK(word->scalar_type() == at::kLong && word->dim() == 1 && word->size(0) == rows &&
                    word->device().is_cpu(),
                name, ": words must be [N] int64 CPU tensors of one length");
  }
}

}  // namespace

// [N] int64 words in [0, 2**32) (c1, c2, c3: counter words 1-3; k0, k1: the key) ->
// [N, num_blocks, 4] int64: block b's four output words.
torch::Tensor philox_rows(const torch::Tensor& c1, const torch::Tensor& c2,
                          const torch::Tensor& c3, const torch::Tensor& k0,
                          const torch::Tensor& k1, int64_t num_blocks) {
  const int64_t rows = c1.size(0);
  check_words(c1, c2, c3, k0, k1, "philox_rows");
  TORCH_CHECK(num_blocks >= 0 && num_blocks < (int64_t{1} << 32), "philox_rows: num_blocks");
  torch::Tensor out = torch::empty({rows, num_blocks, 4}, c1.options());
  const torch::Tensor w1 = c1.contiguous(), w2 = c2.contiguous(), w3 = c3.contiguous();
  const torch::Tensor key0 = k0.contiguous(), key1 = k1.contiguous();
  int64_t* os = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t keys0[kRounds], keys1[kRounds];
    round_keys(key0.data_ptr<int64_t>()[r], key1.data_ptr<int64_t>()[r], keys0, keys1);
    const uint32_t s1 = static_cast<uint32_t>(w1.data_ptr<int64_t>()[r]);
    const uint32_t s2 = static_cast<uint32_t>(w2.data_ptr<int64_t>()[r]);
    const uint32_t s3 = static_cast<uint32_t>(w3.data_ptr<int64_t>()[r]);
    int64_t* row = os + r * num_blocks * 4;
    for (int64_t b = 0; b < num_blocks; ++b) {
      uint32_t words[4];
      philox_block(static_cast<uint32_t>(b), s1, s2, s3, keys0, keys1, words);
      for (int j = 0; j < 4; ++j) row[b * 4 + j] = words[j];
    }
  }
  return out;
}

// The same rounds mapped straight to `specdec.rng.draws.uniform`'s float32 lanes: lane l of row r
// is word l % 4 of block l / 4, as `words_to_uniform32` maps it: float(w), + 0.5, * 2**-32 (each
// a float32 operation rounded as PyTorch's, the last exact), at most 1 - 2**-24. [N] words ->
// [N, num_lanes] float32, without the [N, blocks, 4] int64 words and the four passes over them;
// blocks are spread over PyTorch's threads (each lane is computed alone: the same bits on any
// number of threads).
torch::Tensor philox_uniform32_rows(const torch::Tensor& c1, const torch::Tensor& c2,
                                    const torch::Tensor& c3, const torch::Tensor& k0,
                                    const torch::Tensor& k1, int64_t num_lanes) {
  const int64_t rows = c1.size(0);
  check_words(c1, c2, c3, k0, k1, "philox_uniform32_rows");
  TORCH_CHECK(num_lanes >= 1 && (num_lanes + 3) / 4 < (int64_t{1} << 32),
              "philox_uniform32_rows: num_lanes");
  const int64_t num_blocks = (num_lanes + 3) / 4;
  torch::Tensor out = torch::empty({rows, num_lanes}, c1.options().dtype(at::kFloat));
  const torch::Tensor w1 = c1.contiguous(), w2 = c2.contiguous(), w3 = c3.contiguous();
  const torch::Tensor key0 = k0.contiguous(), key1 = k1.contiguous();
  const int64_t* s1s = w1.data_ptr<int64_t>();
  const int64_t* s2s = w2.data_ptr<int64_t>();
  const int64_t* s3s = w3.data_ptr<int64_t>();
  const int64_t* k0s = key0.data_ptr<int64_t>();
  const int64_t* k1s = key1.data_ptr<int64_t>();
  float* os = out.data_ptr<float>();
  const int64_t tasks_per_row = (num_blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  at::parallel_for(0, rows * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / tasks_per_row;
      const int64_t first = (task % tasks_per_row) * kBlocksPerTask;
      const int64_t last = std::min(first + kBlocksPerTask, num_blocks);
      uint32_t keys0[kRounds], keys1[kRounds];
      round_keys(k0s[r], k1s[r], keys0, keys1);
      const uint32_t s1 = static_cast<uint32_t>(s1s[r]);
      const uint32_t s2 = static_cast<uint32_t>(s2s[r]);
      const uint32_t s3 = static_cast<uint32_t>(s3s[r]);
      float* row = os + r * num_lanes;
      for (int64_t b = first; b < last; ++b) {
        uint32_t words[4];
        philox_block(static_cast<uint32_t>(b), s1, s2, s3, keys0, keys1, words);
        const int64_t lanes = std::min<int64_t>(4, num_lanes - 4 * b);
        for (int64_t j = 0; j < lanes; ++j) {
          float u = static_cast<float>(words[j]);  // exact below 2**24, else rounded to nearest
          u = u + 0.5f;
          u = u * 0x1p-32f;
          row[4 * b + j] = u > kUniform32Max ? kUniform32Max : u;
        }
      }
    }
  });
  return out;
}

// [N, V] float32 logits -> [N] bool: rows with no finite value (all NaN or -inf) or with a +inf,
// `specdec.sampling.processing.unusable_rows` in one pass (comparisons only: the same answer).
torch::Tensor unusable_rows_f32(const torch::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.device().is_cpu(),
              "unusable_rows_f32: logits must be a [N, V] float32 CPU tensor");
  const torch::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  torch::Tensor out = torch::empty({rows}, x.options().dtype(at::kBool));
  const float* xs = x.data_ptr<float>();
  bool* os = out.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xs + r * vocab;
      bool finite = false, posinf = false;
      for (int64_t v = 0; v < vocab; ++v) {
        const float value = row[v];
        finite |= std::isfinite(value);
        posinf |= value == std::numeric_limits<float>::infinity();
      }
      os[r] = !finite || posinf;
    }
  });
  return out;
}
