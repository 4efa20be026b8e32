//! Tokenizers: the embedded byte-level one, HF `tokenizer.json` through the `tokenizers`
//! crate, or none (token ids only). Streaming detokenization emits text only once it is
//! complete UTF-8, seeded with the prompt's last tokens so spacing comes out right.

use std::path::Path;

use super::ModelError;
use super::random::{TINY_BOS, TINY_EOS};

/// How token ids become text.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// Ids 0..=255 are bytes; BOS/EOS and above are special.
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
    /// No tokenizer: text is empty, ids are the output.
    None,
}

/// Tokens the stream seeds its context with.
const SEED_TOKENS: usize = 5;

impl Tokenizer {
    /// `dir/tokenizer.json` when present, else [`Tokenizer::None`].
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(Tokenizer::None);
        }
        tokenizers::Tokenizer::from_file(&path)
            .map(|t| Tokenizer::Hf(Box::new(t)))
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))
    }

    /// Text → ids (adds BOS for the byte tokenizer).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        match self {
            Tokenizer::Bytes => Ok(std::iter::once(TINY_BOS).chain(text.bytes().map(u32::from)).collect()),
            Tokenizer::Hf(t) => t
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::Input(format!("tokenize: {e}"))),
            Tokenizer::None => Err(ModelError::Input(
                "this model has no tokenizer.json: pass token ids (--prompt-tokens) instead of text".into(),
            )),
        }
    }

    /// Ids → text, special tokens left out (empty without a tokenizer).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter_map(|i| u8::try_from(*i).ok()).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Hf(t) => t.decode(ids, true).unwrap_or_default(),
            Tokenizer::None => String::new(),
        }
    }

    /// Streaming-decoder state whose context starts with `context` (the prompt's tail).
    pub fn text_state(&self, context: &[u32]) -> TextState {
        let start = context.len().saturating_sub(SEED_TOKENS);
        TextState {
            ids: context[start..].to_vec(),
            prefix: String::new(),
            prefix_index: 0,
            pending: Vec::new(),
        }
    }
}

/// Incremental detokenizer state of one request (used with the tokenizer that made it).
#[derive(Debug, Clone)]
pub struct TextState {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    pending: Vec<u8>,
}

impl TextState {
    /// Text that `id` completes (possibly empty while a character is still partial).
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> String {
        match tok {
            Tokenizer::Bytes => {
                if id < 256 {
                    self.pending.push(id as u8);
                } else if id == TINY_EOS || id == TINY_BOS {
                    return String::new();
                }
                match std::str::from_utf8(&self.pending) {
                    Ok(s) => {
                        let out = s.to_string();
                        self.pending.clear();
                        out
                    }
                    // An incomplete sequence at the end waits for more bytes; an invalid one
                    // is emitted lossily so the stream never stalls.
                    Err(e) if e.error_len().is_none() && self.pending.len() < 4 => String::new(),
                    Err(_) => {
                        String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned()
                    }
                }
            }
            Tokenizer::Hf(t) => tokenizers::tokenizer::step_decode_stream(
                t,
                vec![id],
                true,
                &mut self.ids,
                &mut self.prefix,
                &mut self.prefix_index,
            )
            .ok()
            .flatten()
            .unwrap_or_default(),
            Tokenizer::None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_stream_waits_for_whole_characters() {
        let t = Tokenizer::Bytes;
        let ids = t.encode("hé").unwrap();
        assert_eq!(ids[0], TINY_BOS);
        let mut s = t.text_state(&[TINY_BOS]);
        let out: Vec<String> = ids[1..].iter().map(|i| s.step(&t, *i)).collect();
        assert_eq!(out, vec!["h".to_string(), String::new(), "é".to_string()]);
        assert_eq!(s.step(&t, TINY_EOS), "");
        assert_eq!(s.step(&t, 0xff), "\u{fffd}");
    }
}
