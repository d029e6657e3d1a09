//! Gated activations of the feed-forward block.

/// Which nonlinearity gates the up projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (swish): Llama, Mistral, Qwen.
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`): Gemma.
    GeluTanh,
}

impl Activation {
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
            }
        }
    }
}

/// `gate[i] = act(gate[i]) * up[i]`: the gated linear unit, in place.
pub fn gated(act: Activation, gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = act.apply(*g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // silu(1) = 1/(1+e^-1); gelu_tanh(1) from PyTorch: 0.8411920071.
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-6);
        assert!((Activation::Silu.apply(-100.0)).abs() < 1e-30);
        assert_eq!(Activation::GeluTanh.apply(0.0), 0.0);
        let mut g = vec![1.0, -2.0, 0.5];
        gated(Activation::Silu, &mut g, &[2.0, 1.0, 0.0]);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
        assert_eq!(g[2], 0.0);
    }
}
