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

/// The rotations of a set of positions: each position's cosines and sines, computed once and
/// shared by every layer's q and k (a decode step of a 30-layer model would otherwise take a
/// sine and a cosine per element, per layer).
#[derive(Debug, Clone)]
pub struct Rotations {
    half: usize,
    /// `[position][half]` of (cos, sin).
    cos_sin: Vec<(f32, f32)>,
}

impl Rotations {
    /// The rotations to `positions` for `inv_freq` (`head_dim / 2`).
    pub fn new(inv_freq: &[f32], positions: &[usize]) -> Self {
        let cos_sin = positions
            .iter()
            .flat_map(|&p| {
                inv_freq.iter().map(move |f| {
                    // HF multiplies in f32: freqs = position.float() * inv_freq.
                    let (sin, cos) = (p as f32 * f).sin_cos();
                    (cos, sin)
                })
            })
            .collect();
        Self {
            half: inv_freq.len(),
            cos_sin,
        }
    }

    /// How many positions.
    pub fn positions(&self) -> usize {
        self.cos_sin.len() / self.half.max(1)
    }

    /// `[position][head_dim / 2]` of (cos, sin): what a device rotates by.
    pub fn table(&self) -> &[(f32, f32)] {
        &self.cos_sin
    }

    /// Rotates every `head_dim`-sized head of `x` (one token) to the `i`-th position.
    pub fn rotate(&self, i: usize, x: &mut [f32]) {
        let half = self.half;
        let cs = &self.cos_sin[i * half..(i + 1) * half];
        for head in x.chunks_exact_mut(2 * half) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), &(cos, sin)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                let (x0, x1) = (*a, *b);
                *a = x0 * cos - x1 * sin;
                *b = x1 * cos + x0 * sin;
            }
        }
    }
}

/// Rotates every `head_dim`-sized head of `x` (one token) to position `pos`.
pub fn apply(x: &mut [f32], inv_freq: &[f32], pos: usize) {
    Rotations::new(inv_freq, &[pos]).rotate(0, x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_rotates_to_its_own_position() {
        let inv: Vec<f32> = (0..4).map(|i| 1.0 / 10f32.powi(i)).collect();
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let table = Rotations::new(&inv, &[0, 5, 9]);
        assert_eq!(table.positions(), 3);
        let mut at0 = x.clone();
        table.rotate(0, &mut at0);
        assert_eq!(at0, x, "position 0 is the identity");
        let (mut a, mut b) = (x.clone(), x.clone());
        table.rotate(2, &mut a);
        apply(&mut b, &inv, 9);
        assert_eq!(a, b);
        // Both heads of the token turn alike: the first pair by 9 radians.
        let (s, c) = 9f32.sin_cos();
        assert_eq!(a[0], x[0] * c - x[4] * s);
        assert_eq!(a[12], x[12] * c + x[8] * s);
    }
}
