//! The mixture-of-experts routing rule as a checkpoint configures it (GGUF `{arch}.expert_*`
//! keys, config.json `num_experts_per_tok`, `n_group`, `scoring_func`, ...) and the relations
//! it must satisfy. Routing itself (router logits to experts and weights) is
//! `model::routing`.

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scoring {
    /// Softmax over all experts.
    Softmax,
    /// Independent sigmoid per expert.
    Sigmoid,
}

/// A routing rule (one per model; every MoE layer routes the same way).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Routing {
    /// Score function.
    pub scoring: Scoring,
    /// Routed experts per layer.
    pub n_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Divide the chosen weights by their sum.
    pub norm_topk: bool,
    /// Expert groups (1: no group limit).
    pub n_group: usize,
    /// Groups a token may choose from.
    pub topk_group: usize,
    /// Multiplies the final weights (`routed_scaling_factor`; 1 for softmax families).
    pub scaling: f32,
}

impl Routing {
    /// Checks the relations routing relies on; the message names the offending key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.n_experts == 0 || self.n_experts > 1 << 16 {
            return Err(("n_experts", format!("{} is out of range", self.n_experts)));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(("num_experts_per_tok", format!("{} is not in 1..={}", self.top_k, self.n_experts)));
        }
        if self.n_group == 0 || !self.n_experts.is_multiple_of(self.n_group) {
            return Err(("n_group", format!("{} does not divide {} experts", self.n_group, self.n_experts)));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(("topk_group", format!("{} is not in 1..={}", self.topk_group, self.n_group)));
        }
        if self.topk_group * (self.n_experts / self.n_group) < self.top_k {
            return Err(("topk_group", format!("{} groups hold fewer than top_k = {} experts", self.topk_group, self.top_k)));
        }
        if !(self.scaling.is_finite() && self.scaling > 0.0) {
            return Err(("routed_scaling_factor", format!("{}", self.scaling)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(scoring: Scoring, n: usize, k: usize, groups: (usize, usize), norm: bool, scaling: f32) -> Routing {
        Routing { scoring, n_experts: n, top_k: k, norm_topk: norm, n_group: groups.0, topk_group: groups.1, scaling }
    }

    #[test]
    fn invalid_rules_name_their_key() {
        assert_eq!(rule(Scoring::Softmax, 8, 9, (1, 1), true, 1.0).validate().unwrap_err().0, "num_experts_per_tok");
        assert_eq!(rule(Scoring::Sigmoid, 8, 2, (3, 1), true, 1.0).validate().unwrap_err().0, "n_group");
        assert_eq!(rule(Scoring::Sigmoid, 8, 4, (4, 1), true, 1.0).validate().unwrap_err().0, "topk_group");
        assert_eq!(rule(Scoring::Sigmoid, 8, 2, (4, 2), true, 0.0).validate().unwrap_err().0, "routed_scaling_factor");
    }
}
