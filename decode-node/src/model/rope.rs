//! Rotary position embedding, as HF transformers computes it (rotate-half form, f32).

use super::config::ModelConfig;

/// Inverse frequencies (`head_dim / 2`), with Llama-3 scaling when configured.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let mut f: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    if let Some(s) = cfg.rope_scaling {
        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        for x in &mut f {
            let wavelen = 2.0 * std::f64::consts::PI / *x;
            let scaled = if wavelen > low_wavelen {
                *x / s.factor
            } else {
                *x
            };
            // HF: neither a high- nor a low-frequency band (written so NaN counts as medium, like HF).
            let medium = (wavelen >= high_wavelen || wavelen.is_nan())
                && (wavelen <= low_wavelen || wavelen.is_nan());
            *x = if medium {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            } else {
                scaled
            };
        }
    }
    f.into_iter().map(|x| x as f32).collect()
}

/// Rotates every `head_dim`-sized head of `x` (one token) to position `pos`.
pub fn apply(x: &mut [f32], inv_freq: &[f32], pos: usize) {
    let half = inv_freq.len();
    let d = 2 * half;
    for head in x.chunks_exact_mut(d) {
        for (i, f) in inv_freq.iter().enumerate() {
            // HF multiplies in f32: freqs = position.float() * inv_freq.
            let angle = pos as f32 * f;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}
