//! GGUF model files (llama.cpp's format) for the Llama architecture: the metadata becomes a
//! [`ModelConfig`], the tensors a [`WeightMap`] under HF names, the vocabulary a tokenizer.
//!
//! F32, F16 and BF16 tensors are served from the memory map as they are; Q8_0, Q4_0 and Q4_1
//! are dequantized once at load into bf16 (what `transformers` does when it loads a GGUF and
//! the model is kept in bf16, so HF goldens made from the same file compare exactly). Any
//! other tensor type is refused by name.
//!
//! The parser is ours, not a crate's: the one maintained GGUF crate (`ggus`) reads a tensor's
//! type by transmuting the file's integer into an enum (undefined behaviour on an unknown type)
//! and `todo!()`s on several types; a model file must not be able to crash the node. Every
//! length and offset here is checked against the file before use.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use attention::KvDType;
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;

use super::ModelError;
use super::config::ModelConfig;
use super::tokenizer::Tokenizer;
use super::weights::{Tensor, WeightMap};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Uint(v) => Some(*v),
            Value::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
    fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(v) => Some(*v),
            Value::Uint(v) => Some(*v as f64),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
    fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// ggml tensor types this loader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl GgmlType {
    fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            30 => Self::Bf16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            other => return Err(ggml_type_name(other)),
        })
    }

    /// (elements, bytes) of one block.
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
    }
}

/// ggml's name of a type id, for the error that refuses it.
fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES
        .get(id as usize)
        .map_or_else(|| format!("type id {id}"), |n| (*n).to_string())
}

/// One tensor's entry in the file.
#[derive(Debug, Clone)]
struct TensorInfo {
    /// Row-major shape (GGUF lists the innermost dimension first; this is reversed).
    shape: Vec<usize>,
    ty: u32,
    /// Offset from the start of the data section.
    offset: u64,
}

/// A parsed GGUF file over its memory map.
#[derive(Debug)]
struct GgufFile {
    map: Arc<Mmap>,
    meta: HashMap<String, Value>,
    tensors: Vec<(String, TensorInfo)>,
    data_start: usize,
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }
    /// A count of items at least `min_item_bytes` each: refused when the rest of the file
    /// cannot hold them, so a corrupt count never reserves memory.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes.max(1) as u64) > left {
            return Err(format!(
                "count {n} at byte {} is larger than the file",
                self.pos
            ));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.count(1)?;
        let at = self.pos;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("string at byte {at} is not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::Uint(self.array::<1>()?[0] as u64),
            1 => Value::Int(self.array::<1>()?[0] as i8 as i64),
            2 => Value::Uint(u16::from_le_bytes(self.array()?) as u64),
            3 => Value::Int(i16::from_le_bytes(self.array()?) as i64),
            4 => Value::Uint(self.u32()? as u64),
            5 => Value::Int(i32::from_le_bytes(self.array()?) as i64),
            6 => Value::Float(f32::from_le_bytes(self.array()?) as f64),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 if depth == 0 => {
                let ety = self.u32()?;
                let n = self.count(1)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("metadata value type {other} is not GGUF's")),
        })
    }
}

impl GgufFile {
    fn open(path: &Path) -> Result<Self, ModelError> {
        let file =
            std::fs::File::open(path).map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        // SAFETY: read-only mapping; as with safetensors, we rely on nobody truncating a model
        // file while it is served.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        Self::parse(Arc::new(map))
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))
    }

    fn parse(map: Arc<Mmap>) -> Result<Self, String> {
        let mut r = Reader { buf: &map, pos: 0 };
        if r.take(4)? != b"GGUF" {
            return Err("not a GGUF file (bad magic)".into());
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version} is not supported (2 or 3)"));
        }
        // A tensor entry is at least 4 + 4 + 4 + 8 bytes; a metadata entry at least 8 + 4 + 1.
        let n_tensors = r.count(20)?;
        let n_meta = r.count(13)?;
        let mut meta = HashMap::with_capacity(n_meta);
        for _ in 0..n_meta {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0).map_err(|e| format!("metadata {key}: {e}"))?;
            meta.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let nd = r.u32()? as usize;
            if nd == 0 || nd > 4 {
                return Err(format!("tensor {name} has {nd} dimensions"));
            }
            let mut shape = (0..nd).map(|_| r.u64()).collect::<Result<Vec<u64>, _>>()?;
            shape.reverse();
            let shape = shape
                .into_iter()
                .map(|d| usize::try_from(d).map_err(|_| format!("tensor {name}: huge dimension")))
                .collect::<Result<Vec<usize>, _>>()?;
            let ty = r.u32()?;
            let offset = r.u64()?;
            tensors.push((name, TensorInfo { shape, ty, offset }));
        }
        let align = match meta.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => return Err(format!("general.alignment {v:?} is not a power of two")),
            },
        };
        let data_start = r.pos.div_ceil(align) * align;
        Ok(Self {
            map,
            meta,
            tensors,
            data_start,
        })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Config(format!("GGUF metadata {key} is missing")))
    }

    fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// A tensor's bytes, checked against the file.
    fn bytes(&self, name: &str, info: &TensorInfo, ty: GgmlType) -> Result<(usize, usize), String> {
        let numel = info
            .shape
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .ok_or_else(|| format!("tensor {name}: too many elements"))?;
        let (per, bytes) = ty.block();
        if numel % per != 0 || info.shape.last().is_some_and(|c| c % per != 0) {
            return Err(format!(
                "tensor {name}: rows are not whole {per}-element blocks"
            ));
        }
        let len = numel / per * bytes;
        let start = usize::try_from(info.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start))
            .filter(|s| s.checked_add(len).is_some_and(|e| e <= self.map.len()))
            .ok_or_else(|| format!("tensor {name} lies outside the file"))?;
        Ok((start, start + len))
    }
}

/// Dequantizes `src` (whole blocks of `ty`) into bf16 little-endian bytes.
fn dequantize_bf16(ty: GgmlType, src: &[u8]) -> Vec<u8> {
    let (per, bytes) = ty.block();
    let blocks = src.len() / bytes;
    let mut out = vec![0u8; blocks * per * 2];
    out.par_chunks_mut(per * 2 * 1024)
        .zip(src.par_chunks(bytes * 1024))
        .for_each(|(o, s)| {
            let mut vals = [0f32; 32];
            for (ob, sb) in o.chunks_exact_mut(per * 2).zip(s.chunks_exact(bytes)) {
                dequantize_block(ty, sb, &mut vals);
                for (d, v) in ob.chunks_exact_mut(2).zip(&vals) {
                    d.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
        });
    out
}

/// One 32-element block of a quantized type, as ggml's reference dequantization defines it.
fn dequantize_block(ty: GgmlType, b: &[u8], out: &mut [f32; 32]) {
    let h = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match ty {
        GgmlType::Q8_0 => {
            let d = h(0);
            for (o, q) in out.iter_mut().zip(&b[2..34]) {
                *o = *q as i8 as f32 * d;
            }
        }
        GgmlType::Q4_0 => {
            let d = h(0);
            for (j, q) in b[2..18].iter().enumerate() {
                out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (h(0), h(2));
            for (j, q) in b[4..20].iter().enumerate() {
                out[j] = (q & 0x0f) as f32 * d + m;
                out[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {}
    }
}

/// llama.cpp stores q and k projections with each head's rows interleaved (pairs rotated
/// together are adjacent, for its RoPE); HF keeps the two halves apart. Row `(head, j, i)` of
/// the file is row `(head, i, j)` of HF, with `i` in 0..2 and `j` in 0..head_dim/2.
fn unpermute_rows(t: &Tensor, heads: usize) -> Result<Tensor, ModelError> {
    let (rows, cols) = (t.rows(), t.cols());
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(ModelError::Weights(format!(
            "a q/k projection of {rows} rows does not split into {heads} heads"
        )));
    }
    let hd = rows / heads;
    let rb = cols * t.dtype.size();
    let src = t.bytes();
    let mut out = vec![0u8; src.len()];
    for head in 0..heads {
        for i in 0..2 {
            for j in 0..hd / 2 {
                let to = head * hd + i * hd / 2 + j;
                let from = head * hd + j * 2 + i;
                out[to * rb..(to + 1) * rb].copy_from_slice(&src[from * rb..(from + 1) * rb]);
            }
        }
    }
    Ok(Tensor::from_bytes(t.shape.clone(), t.dtype, out))
}

/// HF name of a GGUF tensor of the Llama architecture.
fn hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// A GGUF model: configuration, weights under HF names and the tokenizer from its metadata.
#[derive(Debug)]
pub struct GgufModel {
    /// Configuration from the metadata.
    pub cfg: ModelConfig,
    /// Weights, quantized ones dequantized to bf16.
    pub weights: WeightMap,
    /// The tokenizer ([`Tokenizer::None`] when the vocabulary's kind is not supported).
    pub tokenizer: Tokenizer,
}

/// Loads a Llama-architecture GGUF file.
pub fn load(path: &Path) -> Result<GgufModel, ModelError> {
    let f = GgufFile::open(path)?;
    let arch = f.str("general.architecture").unwrap_or("");
    if arch != "llama" {
        return Err(ModelError::Config(format!(
            "GGUF architecture {arch:?} is not supported (only llama)"
        )));
    }
    let key = |k: &str| format!("llama.{k}");
    let num_heads = f.usize(&key("attention.head_count"))?;
    let hidden = f.usize(&key("embedding_length"))?;
    let num_kv_heads = match f.get(&key("attention.head_count_kv")) {
        Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| {
            ModelError::Config("GGUF attention.head_count_kv is not one number per model".into())
        })?,
        None => num_heads,
    };
    let mut weights = WeightMap::default();
    let mut qk_dtype = None;
    for (name, info) in &f.tensors {
        let Some(hf) = hf_name(name) else {
            if name == "rope_freqs.weight" {
                return Err(ModelError::Config(
                    "GGUF rope_freqs (Llama 3 RoPE scaling as a tensor) is not supported".into(),
                ));
            }
            tracing::warn!(tensor = %name, "unused tensor in GGUF file");
            continue;
        };
        let ty = GgmlType::from_id(info.ty).map_err(|t| {
            ModelError::Weights(format!(
                "tensor {name}: type {t} is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1)"
            ))
        })?;
        let (s, e) = f.bytes(name, info, ty).map_err(ModelError::Weights)?;
        let shape = info.shape.clone();
        let mut t = match ty {
            GgmlType::F32 => Tensor::mapped(shape, KvDType::F32, f.map.clone(), s..e),
            GgmlType::F16 => Tensor::mapped(shape, KvDType::F16, f.map.clone(), s..e),
            GgmlType::Bf16 => Tensor::mapped(shape, KvDType::Bf16, f.map.clone(), s..e),
            q => Tensor::from_bytes(shape, KvDType::Bf16, dequantize_bf16(q, &f.map[s..e])),
        };
        if name.ends_with("attn_q.weight") {
            t = unpermute_rows(&t, num_heads)?;
            qk_dtype = Some(t.dtype);
        } else if name.ends_with("attn_k.weight") {
            t = unpermute_rows(&t, num_kv_heads)?;
        }
        weights.insert(hf, t);
    }
    let tokens = match f.get("tokenizer.ggml.tokens") {
        Some(Value::Array(v)) => v.len(),
        _ => 0,
    };
    let vocab_size = match f.get(&key("vocab_size")).and_then(Value::as_u64) {
        Some(v) => v as usize,
        None if tokens > 0 => tokens,
        None => return Err(ModelError::Config("GGUF has no vocabulary size".into())),
    };
    let head_dim = match f.get(&key("attention.key_length")).and_then(Value::as_u64) {
        Some(d) => d as usize,
        None if num_heads > 0 => hidden / num_heads,
        None => 0,
    };
    let tie = weights.remaining().all(|n| n != "lm_head.weight");
    let json = serde_json::json!({
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": f.usize(&key("feed_forward_length"))?,
        "num_hidden_layers": f.usize(&key("block_count"))?,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": f.get(&key("attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5),
        "rope_theta": f.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10_000.0),
        "max_position_embeddings": f.usize(&key("context_length")).unwrap_or(4096),
        "tie_word_embeddings": tie,
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64),
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64),
        "torch_dtype": match qk_dtype {
            Some(KvDType::F32) => "float32",
            Some(KvDType::F16) => "float16",
            _ => "bfloat16",
        },
    });
    let cfg = ModelConfig::from_json(&json.to_string())?;
    let tokenizer = match tokenizer_json(&f) {
        Ok(j) => tokenizers::Tokenizer::from_bytes(j.to_string().as_bytes())
            .map(|t| Tokenizer::Hf(Box::new(t)))
            .map_err(|e| ModelError::Config(format!("GGUF tokenizer: {e}")))?,
        Err(why) => {
            tracing::warn!(%why, "no tokenizer from the GGUF metadata: token ids only");
            Tokenizer::None
        }
    };
    Ok(GgufModel {
        cfg,
        weights,
        tokenizer,
    })
}

/// How text is split before BPE, by `tokenizer.ggml.pre` (grouped as llama.cpp groups them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreSplit {
    /// GPT-2's regex (the byte-level pre-tokenizer's own).
    Gpt2,
    /// Every digit alone, then GPT-2's regex (SmolLM, StarCoder).
    DigitsGpt2,
    /// Llama 3's regex.
    Llama3,
}

fn pre_split(pre: &str) -> Option<PreSplit> {
    match pre {
        "default" | "gpt-2" | "gpt2" => Some(PreSplit::Gpt2),
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva" => {
            Some(PreSplit::DigitsGpt2)
        }
        "llama3" | "llama-bpe" | "llama-v3" => Some(PreSplit::Llama3),
        _ => None,
    }
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A `tokenizer.json` equivalent to the GGUF vocabulary (byte-level BPE only).
fn tokenizer_json(f: &GgufFile) -> Result<serde_json::Value, String> {
    let model = f.str("tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(format!(
            "tokenizer.ggml.model {model:?} is not byte-level BPE (gpt2)"
        ));
    }
    let pre = f.str("tokenizer.ggml.pre").unwrap_or("default");
    let split =
        pre_split(pre).ok_or_else(|| format!("tokenizer.ggml.pre {pre:?} is not supported"))?;
    let strings = |k: &str| -> Result<Vec<&str>, String> {
        match f.get(k) {
            Some(Value::Array(v)) => v
                .iter()
                .map(|x| x.as_str().ok_or_else(|| format!("{k} holds a non-string")))
                .collect(),
            _ => Err(format!("{k} is missing")),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match f.get("tokenizer.ggml.token_type") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| match x {
                Value::Int(i) => *i,
                Value::Uint(u) => *u as i64,
                _ => 1,
            })
            .collect(),
        _ => Vec::new(),
    };
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_string(), i.into()))
        .collect();
    // Control (3) and user-defined (4) tokens are matched whole in text, as HF does.
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let ty = types.get(i).copied().unwrap_or(1);
            (ty == 3 || ty == 4).then(|| {
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == 3})
            })
        })
        .collect();
    let byte_level = |use_regex: bool| {
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": use_regex})
    };
    let pretok = match split {
        PreSplit::Gpt2 => vec![byte_level(true)],
        PreSplit::DigitsGpt2 => vec![
            serde_json::json!({"type": "Digits", "individual_digits": true}),
            byte_level(true),
        ],
        PreSplit::Llama3 => vec![
            serde_json::json!({"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT},
                "behavior": "Isolated", "invert": false}),
            byte_level(false),
        ],
    };
    let add_bos = matches!(
        f.get("tokenizer.ggml.add_bos_token"),
        Some(Value::Bool(true))
    );
    let post = match (
        add_bos,
        f.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64),
    ) {
        (true, Some(bos)) => {
            let name = tokens
                .get(bos as usize)
                .ok_or("tokenizer.ggml.bos_token_id is outside the vocabulary")?;
            serde_json::json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {*name: {"id": name, "ids": [bos], "tokens": [name]}}})
        }
        _ => serde_json::Value::Null,
    };
    Ok(serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretok},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges},
    }))
}

/// Whether `path` names a GGUF file (by its magic, so the extension does not matter).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF writer for tests: metadata of strings/u32/f32/string arrays, tensors as given.
    pub(crate) struct Writer {
        meta: Vec<u8>,
        n_meta: u64,
        infos: Vec<u8>,
        data: Vec<u8>,
        n_tensors: u64,
    }

    impl Writer {
        pub(crate) fn new() -> Self {
            Self {
                meta: Vec::new(),
                n_meta: 0,
                infos: Vec::new(),
                data: Vec::new(),
                n_tensors: 0,
            }
        }
        fn s(buf: &mut Vec<u8>, s: &str) {
            buf.extend((s.len() as u64).to_le_bytes());
            buf.extend(s.as_bytes());
        }
        pub(crate) fn u32(&mut self, k: &str, v: u32) -> &mut Self {
            Self::s(&mut self.meta, k);
            self.meta.extend(4u32.to_le_bytes());
            self.meta.extend(v.to_le_bytes());
            self.n_meta += 1;
            self
        }
        pub(crate) fn f32(&mut self, k: &str, v: f32) -> &mut Self {
            Self::s(&mut self.meta, k);
            self.meta.extend(6u32.to_le_bytes());
            self.meta.extend(v.to_le_bytes());
            self.n_meta += 1;
            self
        }
        pub(crate) fn str(&mut self, k: &str, v: &str) -> &mut Self {
            Self::s(&mut self.meta, k);
            self.meta.extend(8u32.to_le_bytes());
            Self::s(&mut self.meta, v);
            self.n_meta += 1;
            self
        }
        pub(crate) fn strs(&mut self, k: &str, v: &[&str]) -> &mut Self {
            Self::s(&mut self.meta, k);
            self.meta.extend(9u32.to_le_bytes());
            self.meta.extend(8u32.to_le_bytes());
            self.meta.extend((v.len() as u64).to_le_bytes());
            for x in v {
                Self::s(&mut self.meta, x);
            }
            self.n_meta += 1;
            self
        }
        /// A tensor of row-major `shape` with raw `bytes` of ggml type `ty`.
        pub(crate) fn tensor(&mut self, name: &str, shape: &[usize], ty: u32, bytes: &[u8]) {
            Self::s(&mut self.infos, name);
            self.infos.extend((shape.len() as u32).to_le_bytes());
            for d in shape.iter().rev() {
                self.infos.extend((*d as u64).to_le_bytes());
            }
            self.infos.extend(ty.to_le_bytes());
            self.infos.extend((self.data.len() as u64).to_le_bytes());
            self.data.extend(bytes);
            self.data.resize(self.data.len().div_ceil(32) * 32, 0);
            self.n_tensors += 1;
        }
        pub(crate) fn finish(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend(3u32.to_le_bytes());
            out.extend(self.n_tensors.to_le_bytes());
            out.extend(self.n_meta.to_le_bytes());
            out.extend(&self.meta);
            out.extend(&self.infos);
            out.resize(out.len().div_ceil(32) * 32, 0);
            out.extend(&self.data);
            out
        }
    }

    fn parse(bytes: &[u8]) -> Result<GgufFile, String> {
        let mut m = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| e.to_string())?;
        m[..bytes.len()].copy_from_slice(bytes);
        let m = m.make_read_only().map_err(|e| e.to_string())?;
        GgufFile::parse(Arc::new(m))
    }

    #[test]
    fn dequantizes_each_type_as_ggml_defines_it() {
        let d = f16::from_f32(0.5).to_le_bytes();
        let m = f16::from_f32(-1.0).to_le_bytes();
        // Q8_0: d, then 32 signed bytes.
        let mut q8 = d.to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = [0f32; 32];
        dequantize_block(GgmlType::Q8_0, &q8, &mut out);
        assert_eq!(out[0], -8.0);
        assert_eq!(out[31], 7.5);
        // Q4_0: low nibbles are elements 0..16, high nibbles 16..32, both offset by 8.
        let mut q4 = d.to_vec();
        q4.extend((0..16u8).map(|i| ((15 - i) << 4) | i));
        dequantize_block(GgmlType::Q4_0, &q4, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[15], 3.5);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[31], -4.0);
        // Q4_1: d, m, nibbles without offset.
        let mut q41 = d.to_vec();
        q41.extend(m);
        q41.extend((0..16u8).map(|i| ((15 - i) << 4) | i));
        dequantize_block(GgmlType::Q4_1, &q41, &mut out);
        assert_eq!(out[0], -1.0);
        assert_eq!(out[15], 6.5);
        assert_eq!(out[16], 6.5);
        let bf = dequantize_bf16(GgmlType::Q4_1, &q41);
        assert_eq!(bf.len(), 64);
        assert_eq!(bf16::from_le_bytes([bf[30], bf[31]]).to_f32(), 6.5);
    }

    #[test]
    fn unpermute_restores_hf_row_order() {
        // Two heads of head_dim 4: HF rows (h, i, j) ← file rows (h, j, i).
        let hf: Vec<f32> = (0..8).map(|r| r as f32).collect();
        let mut file = vec![0f32; 8];
        for h in 0..2 {
            for i in 0..2 {
                for j in 0..2 {
                    file[h * 4 + j * 2 + i] = hf[h * 4 + i * 2 + j];
                }
            }
        }
        let t = Tensor::from_f32(vec![8, 1], &file);
        assert_eq!(unpermute_rows(&t, 2).unwrap().to_f32(), hf);
        assert!(unpermute_rows(&t, 3).is_err());
    }

    #[test]
    fn corrupt_files_are_errors_not_panics() {
        let mut w = Writer::new();
        w.str("general.architecture", "llama")
            .u32("llama.block_count", 1);
        w.tensor("token_embd.weight", &[2, 32], 3, &[0u8; 40]);
        let good = w.finish();
        assert!(parse(&good).is_ok());
        // Every truncation is refused cleanly.
        for cut in 0..good.len() - 40 {
            let _ = parse(&good[..cut]);
        }
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(parse(&bad).unwrap_err().contains("magic"));
        // A count far beyond the file reserves nothing and fails.
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(&huge).is_err());
        // Single-byte corruption anywhere in the header never panics.
        for i in 0..good.len() - 40 {
            let mut c = good.clone();
            c[i] ^= 0xff;
            if let Ok(f) = parse(&c) {
                for (n, info) in &f.tensors {
                    if let Ok(ty) = GgmlType::from_id(info.ty) {
                        let _ = f.bytes(n, info, ty);
                    }
                }
            }
        }
    }

    /// The GGUF name of an HF tensor (the inverse of [`hf_name`]).
    fn gguf_name(hf: &str) -> String {
        let fixed = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return (*g).into();
        }
        for layer in 0..64 {
            let name = format!("blk.{layer}.");
            for part in [
                "attn_norm",
                "ffn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ] {
                let g = format!("{name}{part}.weight");
                if hf_name(&g).as_deref() == Some(hf) {
                    return g;
                }
            }
        }
        panic!("no GGUF name for {hf}")
    }

    /// Q8_0 blocks of `v` (whole blocks of 32).
    fn quantize_q8(v: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for b in v.chunks_exact(32) {
            let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = f16::from_f32(amax / 127.0);
            let inv = if d.to_f32() == 0.0 {
                0.0
            } else {
                1.0 / d.to_f32()
            };
            out.extend(d.to_le_bytes());
            out.extend(
                b.iter()
                    .map(|x| (x * inv).round().clamp(-127.0, 127.0) as i8 as u8),
            );
        }
        out
    }

    #[test]
    fn a_gguf_model_equals_the_same_weights_in_hf_layout() {
        use crate::backend::CpuBackend;
        use crate::model::Model;
        use crate::model::random::{preset, random_weights};
        let mut cfg = preset("tiny", super::super::Arch::Llama).unwrap();
        cfg.tie_word_embeddings = true;
        cfg.intermediate_size = 192;
        let mut hf = random_weights(&cfg, 5, KvDType::F32);
        let _ = hf.take_opt("lm_head.weight", &[cfg.vocab_size, cfg.hidden_size]);
        let names: Vec<String> = hf.remaining().map(String::from).collect();
        let mut w = Writer::new();
        w.str("general.architecture", "llama")
            .u32("llama.block_count", cfg.num_layers as u32)
            .u32("llama.embedding_length", cfg.hidden_size as u32)
            .u32("llama.feed_forward_length", cfg.intermediate_size as u32)
            .u32("llama.attention.head_count", cfg.num_heads as u32)
            .u32("llama.attention.head_count_kv", cfg.num_kv_heads as u32)
            .u32("llama.context_length", cfg.max_position_embeddings as u32)
            .u32("llama.vocab_size", cfg.vocab_size as u32)
            .f32("llama.rope.freq_base", cfg.rope_theta as f32)
            .f32(
                "llama.attention.layer_norm_rms_epsilon",
                cfg.rms_norm_eps as f32,
            )
            .str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", "smollm")
            .strs("tokenizer.ggml.tokens", &["a", "b", "ab", "Ġ", "1"])
            .strs("tokenizer.ggml.merges", &["a b"]);
        let mut quantized = HashMap::new();
        for n in &names {
            let t = hf_tensor(&mut hf, n);
            let g = gguf_name(n);
            let heads = if n.ends_with("q_proj.weight") {
                Some(cfg.num_heads)
            } else if n.ends_with("k_proj.weight") {
                Some(cfg.num_kv_heads)
            } else {
                None
            };
            // The file holds llama.cpp's interleaved q/k rows: permute HF's forward.
            let rows = match heads {
                Some(h) => permute_rows(&t.to_f32(), t.rows(), t.cols(), h),
                None => t.to_f32(),
            };
            if n.ends_with("mlp.up_proj.weight") {
                let q = quantize_q8(&rows);
                w.tensor(&g, &t.shape, 8, &q);
                let mut deq = Vec::new();
                for b in q.chunks_exact(34) {
                    let mut out = [0f32; 32];
                    dequantize_block(GgmlType::Q8_0, b, &mut out);
                    deq.extend(out.iter().map(|x| bf16::from_f32(*x).to_f32()));
                }
                quantized.insert(n.clone(), deq);
            } else {
                let bytes: Vec<u8> = rows.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.tensor(&g, &t.shape, 0, &bytes);
            }
            // The reference model gets HF's rows (dequantized where the file is quantized).
            let reference = quantized.get(n).cloned().unwrap_or_else(|| t.to_f32());
            hf.insert(n.clone(), Tensor::from_f32(t.shape.clone(), &reference));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, w.finish()).unwrap();
        assert!(is_gguf(&path));
        let g = load(&path).unwrap();
        assert_eq!(g.cfg.num_kv_heads, cfg.num_kv_heads);
        assert!(g.cfg.tie_word_embeddings);
        let ids = match &g.tokenizer {
            Tokenizer::Hf(t) => t.encode("ab a1", false).unwrap().get_ids().to_vec(),
            other => panic!("no tokenizer: {other:?}"),
        };
        // "ab" merges; " a" has no merge with the space marker; the digit is split off.
        assert_eq!(ids, vec![2, 3, 0, 4]);
        let a = Model::from_weights(g.cfg.clone(), "g", g.weights, Arc::new(CpuBackend)).unwrap();
        let b = Model::from_weights(cfg.clone(), "g", hf, Arc::new(CpuBackend)).unwrap();
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 250) as u32).collect();
        let (la, lb) = (a.prefill(&prompt).unwrap(), b.prefill(&prompt).unwrap());
        // Equal up to summation order: the dequantized projection is bf16 on one side and
        // f32 on the other, and bf16 rows are summed in another lane order (a loader that
        // misplaced a row or a scale would be off by far more).
        let close = |x: &[f32], y: &[f32]| {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|(p, q)| (p - q).abs() <= 1e-5 * q.abs().max(1.0))
        };
        assert!(close(&la.logits, &lb.logits));
        assert!(la.keys.iter().zip(&lb.keys).all(|(p, q)| close(p, q)));
    }

    fn hf_tensor(wm: &mut WeightMap, name: &str) -> Tensor {
        wm.take_any(name).unwrap()
    }

    /// llama.cpp's permutation of q/k rows (HF row `(h, i, j)` to file row `(h, j, i)`).
    fn permute_rows(v: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        let hd = rows / heads;
        let mut out = vec![0f32; v.len()];
        for h in 0..heads {
            for i in 0..2 {
                for j in 0..hd / 2 {
                    let from = h * hd + i * hd / 2 + j;
                    let to = h * hd + j * 2 + i;
                    out[to * cols..(to + 1) * cols]
                        .copy_from_slice(&v[from * cols..(from + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unsupported_tensor_types_are_named() {
        assert_eq!(GgmlType::from_id(12).unwrap_err(), "Q4_K");
        assert_eq!(GgmlType::from_id(9999).unwrap_err(), "type id 9999");
    }
}
