//! Sampling parameters and their validation.

/// How the next token is chosen, and what is reported about it.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set with cumulative probability >= top_p (1: off).
    pub top_p: f32,
    /// Drop tokens with probability < min_p x the top probability (0: off).
    pub min_p: f32,
    /// Divide positive / multiply negative logits of every token seen (prompt + output); 1: off.
    pub repetition_penalty: f32,
    /// Subtract from logits of tokens present in the output; 0: off.
    pub presence_penalty: f32,
    /// Subtract count x this from logits of tokens in the output; 0: off.
    pub frequency_penalty: f32,
    /// RNG seed: same seed, same prompt, same output.
    pub seed: Option<u64>,
    /// Report this many top alternatives with each token's logprob (`None`: no logprobs).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Checks ranges; the error names the parameter (as OpenAI-style APIs do).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let finite = |name, v: f32| if v.is_finite() { Ok(()) } else { Err((name, format!("{name} must be finite"))) };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err(("temperature", format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(("top_p", format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(("min_p", format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(("repetition_penalty", format!("repetition_penalty must be > 0, got {}", self.repetition_penalty)));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err((name, format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if let Some(n) = self.logprobs {
            if n > 20 {
                return Err(("logprobs", format!("logprobs must be in [0, 20], got {n}")));
            }
        }
        Ok(())
    }
}
