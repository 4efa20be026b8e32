//! Weight tensors read from safetensors files through memmap2, without copying.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use attention::KvDType;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::ModelError;
pub use crate::tensor::Tensor;

/// Maps a safetensors dtype to ours.
fn dtype_of(d: Dtype, name: &str) -> Result<KvDType, ModelError> {
    match d {
        Dtype::F32 => Ok(KvDType::F32),
        Dtype::F16 => Ok(KvDType::F16),
        Dtype::BF16 => Ok(KvDType::Bf16),
        other => Err(ModelError::Weights(format!(
            "tensor {name}: dtype {other:?} is not f32, f16 or bf16"
        ))),
    }
}

/// Every tensor of a model directory (`model.safetensors` or a sharded index), by name.
#[derive(Debug, Default)]
pub struct WeightMap {
    tensors: HashMap<String, Tensor>,
}

impl WeightMap {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| ModelError::Io(index.display().to_string(), e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::Weights(format!("{}: no weight_map", index.display()))
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
                .into_iter()
                .map(|f| {
                    if f.contains('/') || f.contains("..") {
                        Err(ModelError::Weights(format!(
                            "shard name {f:?} leaves the model directory"
                        )))
                    } else {
                        Ok(dir.join(f))
                    }
                })
                .collect::<Result<_, _>>()?
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut out = WeightMap::default();
        for f in files {
            out.add_file(&f)?;
        }
        Ok(out)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let file =
            std::fs::File::open(path).map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        // SAFETY: the file is opened read-only; like every mmap-based loader (candle, HF) we
        // rely on nobody truncating a checkpoint while it is served.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| ModelError::Io(path.display().to_string(), e))?;
        let map = Arc::new(map);
        let (header_len, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        let base = 8 + header_len;
        for (name, info) in meta.tensors() {
            let dtype = dtype_of(info.dtype, &name)?;
            let (s, e) = info.data_offsets;
            let range = base + s..base + e;
            let numel: usize = info.shape.iter().product();
            if range.end > map.len() || e - s != numel * dtype.size() {
                return Err(ModelError::Weights(format!(
                    "{}: tensor {name} has bad offsets",
                    path.display()
                )));
            }
            self.tensors.insert(
                name,
                Tensor::mapped(info.shape.clone(), dtype, map.clone(), range),
            );
        }
        Ok(())
    }

    /// Inserts a tensor (the embedded model builds its weights this way).
    pub fn insert(&mut self, name: impl Into<String>, t: Tensor) {
        self.tensors.insert(name.into(), t);
    }

    /// Removes and returns `name`, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::Weights(format!("missing tensor {name}")))?;
        if t.shape != shape {
            return Err(ModelError::Weights(format!(
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.shape
            )));
        }
        Ok(t)
    }

    /// Removes and returns `name` whatever its shape.
    pub fn take_any(&mut self, name: &str) -> Result<Tensor, ModelError> {
        self.tensors
            .remove(name)
            .ok_or_else(|| ModelError::Weights(format!("missing tensor {name}")))
    }

    /// Removes `name` if present, checking its shape.
    pub fn take_opt(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>, ModelError> {
        if self.tensors.contains_key(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Names left (for warnings about unused tensors).
    pub fn remaining(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Writes every tensor as one `model.safetensors`.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(n, t)| {
                let dt = match t.dtype {
                    KvDType::F32 => Dtype::F32,
                    KvDType::F16 => Dtype::F16,
                    KvDType::Bf16 => Dtype::BF16,
                    KvDType::I8 => Dtype::I8,
                    KvDType::F8E4M3 => Dtype::F8_E4M3,
                };
                safetensors::tensor::TensorView::new(dt, t.shape.clone(), t.bytes())
                    .map(|v| (n.clone(), v))
                    .map_err(|e| ModelError::Weights(format!("{n}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        safetensors::serialize_to_file(views, None, path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))
    }
}
