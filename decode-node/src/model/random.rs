//! Random-weight models in HF format: the embedded `tiny` model and `make-model`.

use attention::{KvDType, encode_from_f32};
use rayon::prelude::*;

use super::config::{Arch, ModelConfig};
use super::weights::{Tensor, WeightMap};

/// SplitMix64: tiny, seedable, good enough for weights and sampling.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

/// SplitMix64's state increment: the k-th draw depends only on `seed + k * GAMMA`, so a stream
/// can be cut into pieces generated in parallel and still be the same stream.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix {
    /// The generator `n` draws later.
    pub fn skipped(&self, n: u64) -> Self {
        Self(self.0.wrapping_add(n.wrapping_mul(GAMMA)))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A tensor of `f` drawn once per element, in order, from `rng` (which ends up past the last
/// draw). Generated in parallel pieces that are cut from the same stream, so the values do not
/// depend on the thread count: 14B-parameter models are made in seconds, not minutes.
fn tensor(
    rng: &mut SplitMix,
    shape: Vec<usize>,
    dtype: KvDType,
    f: impl Fn(&mut SplitMix) -> f32 + Sync,
) -> Tensor {
    const PIECE: usize = 1 << 16;
    let n: usize = shape.iter().product();
    let es = dtype.size();
    let mut bytes = vec![0u8; n * es];
    let start = rng.clone();
    bytes
        .par_chunks_mut(PIECE * es)
        .enumerate()
        .for_each(|(i, out)| {
            let mut r = start.skipped((i * PIECE) as u64);
            let v: Vec<f32> = (0..out.len() / es).map(|_| f(&mut r)).collect();
            encode_from_f32(dtype, &v, out);
        });
    *rng = start.skipped(n as u64);
    Tensor::from_bytes(shape, dtype, bytes)
}

/// Random weights for `cfg`: projections with unit-variance outputs, norms near 1.
pub fn random_weights(cfg: &ModelConfig, seed: u64, dtype: KvDType) -> WeightMap {
    let mut rng = SplitMix(seed);
    let mut wm = WeightMap::default();
    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let uni = |a: f32| move |r: &mut SplitMix| ((r.next_f64() * 2.0 - 1.0) as f32) * a;
    let lin_amp = |inp: usize| (3.0f32 / inp as f32).sqrt();
    let norm = |r: &mut SplitMix| 1.0 + ((r.next_f64() - 0.5) * 0.2) as f32;
    wm.insert(
        "model.embed_tokens.weight",
        tensor(&mut rng, vec![cfg.vocab_size, h], dtype, uni(1.0)),
    );
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        let mut put = |name: &str, shape: Vec<usize>, f: &(dyn Fn(&mut SplitMix) -> f32 + Sync)| {
            wm.insert(format!("{p}.{name}"), tensor(&mut rng, shape, dtype, f));
        };
        put("input_layernorm.weight", vec![h], &norm);
        put("post_attention_layernorm.weight", vec![h], &norm);
        put("self_attn.q_proj.weight", vec![qd, h], &uni(lin_amp(h)));
        put("self_attn.k_proj.weight", vec![kvd, h], &uni(lin_amp(h)));
        put("self_attn.v_proj.weight", vec![kvd, h], &uni(lin_amp(h)));
        put("self_attn.o_proj.weight", vec![h, qd], &uni(lin_amp(qd)));
        if cfg.qkv_bias {
            put("self_attn.q_proj.bias", vec![qd], &uni(0.1));
            put("self_attn.k_proj.bias", vec![kvd], &uni(0.1));
            put("self_attn.v_proj.bias", vec![kvd], &uni(0.1));
        }
        if cfg.qk_norm {
            put("self_attn.q_norm.weight", vec![hd], &norm);
            put("self_attn.k_norm.weight", vec![hd], &norm);
        }
        put("mlp.gate_proj.weight", vec![inter, h], &uni(lin_amp(h)));
        put("mlp.up_proj.weight", vec![inter, h], &uni(lin_amp(h)));
        put("mlp.down_proj.weight", vec![h, inter], &uni(lin_amp(inter)));
    }
    wm.insert("model.norm.weight", tensor(&mut rng, vec![h], dtype, norm));
    if !cfg.tie_word_embeddings {
        wm.insert(
            "lm_head.weight",
            tensor(&mut rng, vec![cfg.vocab_size, h], dtype, uni(lin_amp(h))),
        );
    }
    wm
}

/// Byte-level vocabulary of the embedded model: bytes 0..=255, then BOS and EOS.
pub const TINY_BOS: u32 = 256;
/// End of sequence of the embedded model.
pub const TINY_EOS: u32 = 257;

/// Geometry of a named preset.
pub fn preset(name: &str, arch: Arch) -> Option<ModelConfig> {
    let base = |h, inter, layers, heads, kv, hd, vocab| ModelConfig {
        arch,
        hidden_size: h,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hd,
        vocab_size: vocab,
        rms_norm_eps: 1e-6,
        rope_theta: if matches!(arch, Arch::Qwen2 | Arch::Qwen3) {
            1_000_000.0
        } else {
            10_000.0
        },
        rope_scaling: None,
        tie_word_embeddings: false,
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: 4096,
        sliding_window: None,
        eos_token_ids: vec![TINY_EOS],
        bos_token_id: Some(TINY_BOS),
        torch_dtype: "float32".into(),
    };
    Some(match name {
        "tiny" => base(64, 172, 4, 4, 2, 16, 260),
        "small" => base(256, 688, 4, 8, 2, 32, 1024),
        "qwen3-8b" => ModelConfig {
            max_position_embeddings: 131_072,
            eos_token_ids: vec![151_645],
            bos_token_id: None,
            torch_dtype: "bfloat16".into(),
            ..base(4096, 12288, 36, 32, 8, 128, 151_936)
        },
        "qwen3-14b" => ModelConfig {
            max_position_embeddings: 131_072,
            eos_token_ids: vec![151_645],
            bos_token_id: None,
            torch_dtype: "bfloat16".into(),
            ..base(5120, 17408, 40, 40, 8, 128, 151_936)
        },
        "llama3-8b" => ModelConfig {
            rope_theta: 500_000.0,
            max_position_embeddings: 131_072,
            eos_token_ids: vec![128_001, 128_009],
            bos_token_id: Some(128_000),
            torch_dtype: "bfloat16".into(),
            rope_scaling: Some(super::config::Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
            ..base(4096, 14336, 32, 32, 8, 128, 128_256)
        },
        _ => return None,
    })
}

/// The embedded deterministic model: Llama-shaped, byte-level vocabulary.
///
/// Its LM head rows of non-printable bytes are zero, so greedy text stays printable ASCII —
/// the demo prints text a person can read, if not sense.
pub fn tiny() -> (ModelConfig, WeightMap) {
    let cfg = preset("tiny", Arch::Llama).unwrap_or_else(|| unreachable!("tiny is a preset"));
    let mut cfg = ModelConfig {
        max_position_embeddings: 32_768,
        ..cfg
    };
    cfg.rms_norm_eps = 1e-5;
    let mut wm = random_weights(&cfg, 0x7157, KvDType::F32);
    let h = cfg.hidden_size;
    if let Ok(head) = wm.take("lm_head.weight", &[cfg.vocab_size, h]) {
        let mut v = head.to_f32();
        for (tok, row) in v.chunks_exact_mut(h).enumerate() {
            let printable = (0x20..0x7f).contains(&tok) || tok == b'\n' as usize;
            if !printable {
                row.fill(0.0);
            }
        }
        wm.insert(
            "lm_head.weight",
            Tensor::from_f32(vec![cfg.vocab_size, h], &v),
        );
    }
    (cfg, wm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_tensors_are_the_sequential_stream() {
        let n = 3 * (1 << 16) + 77;
        let mut seq = SplitMix(42);
        let want: Vec<f32> = (0..n)
            .map(|_| ((seq.next_f64() * 2.0 - 1.0) as f32) * 0.5)
            .collect();
        let mut rng = SplitMix(42);
        let t = tensor(&mut rng, vec![n], KvDType::F32, |r| {
            ((r.next_f64() * 2.0 - 1.0) as f32) * 0.5
        });
        assert_eq!(t.to_f32(), want);
        // The generator continues where the sequential one would.
        assert_eq!(rng.next_u64(), seq.next_u64());
    }
}
