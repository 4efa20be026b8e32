//! Model configuration: Hugging Face `config.json` for the Llama family.

use std::path::Path;

use serde::Deserialize;

use super::ModelError;

/// Architecture family; all run through the same Llama-style forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3.
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v projections carry a bias.
    Qwen2,
    /// Qwen3: per-head RMSNorm of q and k before RoPE.
    Qwen3,
    /// Mistral. Sliding-window attention is not implemented: a config with a window caps the
    /// context at it (see [`ModelConfig::max_context`]).
    Mistral,
}

impl Arch {
    /// The `model_type` string of HF configs.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
        }
    }

    /// Parses a `model_type` (or `--arch`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "mistral" => Some(Arch::Mistral),
            _ => None,
        }
    }
}

/// Llama-3 style RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: f64,
}

/// Everything the executor needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Family.
    pub arch: Arch,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP intermediate size.
    pub intermediate_size: usize,
    /// Layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, when configured.
    pub rope_scaling: Option<Llama3Scaling>,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections have a bias (Qwen2, or `attention_bias`).
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm (Qwen3).
    pub qk_norm: bool,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Sliding attention window, when the config turns one on (Mistral's `sliding_window`,
    /// Qwen2/3's with `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    /// BOS id, when the model has one.
    pub bos_token_id: Option<u32>,
    /// `torch_dtype` of the checkpoint (`float32`, `float16`, `bfloat16`).
    pub torch_dtype: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    rope_theta: Option<f64>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawScaling>,
    /// transformers 5 keeps `rope_theta` and the scaling here.
    rope_parameters: Option<RawScaling>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

impl ModelConfig {
    /// Longest context served: prompt plus generated tokens. A model with a sliding window
    /// attends only to its last `sliding_window` tokens; we attend to all of them, which is the
    /// same thing only while the context fits the window, so the context is capped there
    /// rather than silently decoding differently from the model beyond it.
    pub fn max_context(&self) -> usize {
        match self.sliding_window {
            Some(w) => w.min(self.max_position_embeddings),
            None => self.max_position_embeddings,
        }
    }

    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        Self::from_json(&text)
    }

    /// Parses a `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let raw: Raw = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let mt = raw.model_type.as_deref().unwrap_or("llama");
        let arch = Arch::parse(mt).ok_or_else(|| {
            ModelError::Config(format!(
                "model_type {mt:?} is not one of llama, qwen2, qwen3, mistral"
            ))
        })?;
        if raw.num_attention_heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return Err(ModelError::Config(
                "hidden_size, num_attention_heads and num_hidden_layers must be > 0".into(),
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                raw.num_attention_heads
            )));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim {head_dim} must be even and > 0"
            )));
        }
        let rope_theta = raw
            .rope_theta
            .or(raw.rope_parameters.as_ref().and_then(|p| p.rope_theta));
        let rope_scaling = match raw.rope_scaling.or(raw.rope_parameters) {
            Some(s) if s.rope_type.as_deref().or(s.kind.as_deref()) == Some("llama3") => {
                Some(Llama3Scaling {
                    factor: s.factor.unwrap_or(8.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: s
                        .original_max_position_embeddings
                        .unwrap_or(8192.0),
                })
            }
            Some(s)
                if matches!(
                    s.rope_type.as_deref().or(s.kind.as_deref()),
                    None | Some("default")
                ) =>
            {
                None
            }
            Some(s) => {
                return Err(ModelError::Config(format!(
                    "rope_scaling type {:?} is not supported (only llama3)",
                    s.rope_type.or(s.kind)
                )));
            }
            None => None,
        };
        let eos_token_ids = match raw.eos_token_id {
            Some(OneOrMany::One(x)) => vec![x],
            Some(OneOrMany::Many(v)) => v,
            None => Vec::new(),
        };
        Ok(Self {
            arch,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || raw.attention_bias.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            // Qwen configs carry a `sliding_window` that is off unless `use_sliding_window`.
            sliding_window: match arch {
                Arch::Qwen2 | Arch::Qwen3 if !raw.use_sliding_window.unwrap_or(false) => None,
                _ => raw.sliding_window.filter(|w| *w > 0),
            },
            eos_token_ids,
            bos_token_id: raw.bos_token_id,
            torch_dtype: raw
                .torch_dtype
                .or(raw.dtype)
                .unwrap_or_else(|| "float32".into()),
        })
    }

    /// The HF `config.json` for this configuration.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [match self.arch {
                Arch::Llama => "LlamaForCausalLM",
                Arch::Qwen2 => "Qwen2ForCausalLM",
                Arch::Qwen3 => "Qwen3ForCausalLM",
                Arch::Mistral => "MistralForCausalLM",
            }],
            "model_type": self.arch.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.torch_dtype,
            "attention_bias": self.qkv_bias && self.arch != Arch::Qwen2,
        });
        if let Some(s) = self.rope_scaling {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = b.into();
        }
        if let Some(w) = self.sliding_window {
            v["sliding_window"] = w.into();
            v["use_sliding_window"] = true.into();
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => v["eos_token_id"] = (*one).into(),
            many => v["eos_token_id"] = many.to_vec().into(),
        }
        v
    }

    /// A stable fingerprint of everything that shapes the KV cache and the math: a prefill
    /// node must send the same string in `KvHeader.model_id`.
    pub fn model_id(&self, name: &str) -> String {
        let canon = format!(
            "{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:?}|{}|{}|{}",
            self.arch.model_type(),
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.rms_norm_eps,
            self.rope_theta,
            self.rope_scaling,
            self.tie_word_embeddings,
            self.qkv_bias,
            self.qk_norm
        );
        // FNV-1a: stable across builds and platforms, unlike std's hasher.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in canon.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{name}-{}-{h:016x}", self.arch.model_type())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sliding_window_caps_the_context() {
        let base = r#""hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,"vocab_size":10,"max_position_embeddings":32768"#;
        let cfg = |extra: &str| ModelConfig::from_json(&format!("{{{base}{extra}}}")).unwrap();
        let m = cfg(r#","model_type":"mistral","sliding_window":4096"#);
        assert_eq!((m.sliding_window, m.max_context()), (Some(4096), 4096));
        assert_eq!(
            cfg(r#","model_type":"mistral","sliding_window":null"#).max_context(),
            32768
        );
        // Qwen configs name a window that is off unless use_sliding_window.
        let q = cfg(r#","model_type":"qwen2","sliding_window":4096,"use_sliding_window":false"#);
        assert_eq!((q.sliding_window, q.max_context()), (None, 32768));
        let q = cfg(r#","model_type":"qwen3","sliding_window":4096,"use_sliding_window":true"#);
        assert_eq!(q.max_context(), 4096);
        // Written back by make-model and read again.
        assert_eq!(
            ModelConfig::from_json(&m.to_json().to_string())
                .unwrap()
                .max_context(),
            4096
        );
    }

    #[test]
    fn parses_qwen3_and_llama3_configs() {
        let q = ModelConfig::from_json(
            r#"{"model_type":"qwen3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":300,
            "tie_word_embeddings":true,"eos_token_id":[1,2],"rope_theta":1000000.0}"#,
        )
        .unwrap();
        assert_eq!(
            (q.arch, q.head_dim, q.qk_norm, q.qkv_bias),
            (Arch::Qwen3, 32, true, false)
        );
        assert_eq!(q.eos_token_ids, vec![1, 2]);
        let l = ModelConfig::from_json(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":300,"eos_token_id":7,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        assert_eq!(l.head_dim, 16);
        assert_eq!(l.num_kv_heads, 4);
        assert!(l.rope_scaling.is_some());
        let back = ModelConfig::from_json(&l.to_json().to_string()).unwrap();
        assert_eq!(back, l);
        assert_ne!(q.model_id("m"), l.model_id("m"));
        assert_eq!(l.model_id("m"), back.model_id("m"));
    }

    #[test]
    fn refuses_bad_configs() {
        assert!(ModelConfig::from_json("{}").is_err());
        assert!(
            ModelConfig::from_json(
                r#"{"model_type":"gpt2","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":3}"#
            )
            .is_err()
        );
        assert!(
            ModelConfig::from_json(
                r#"{"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":3}"#
            )
            .is_err()
        );
    }
}
