//! `ZeroStage`: the ZeRO stage of `dist.zero_stage` as a type, owning every rule the training loop,
//! the checkpoint and the plan ask of it (Rajbhandari et al. 2020, ZeRO).
//!
//! Each question is a method named after the rule, not a comparison of integers: who owns optimizer
//! state, how many gradient elements a rank holds, how parameters are obtained, whether weights are
//! published after a step, how gradients are reduced, whether a checkpoint or an evaluation needs the
//! full weights gathered. At one rank every stage is the same computation.
//!
//! It lives under config (the `[dist]` section's vocabulary, below every reader of it): config calls
//! nobody above it.
//!
//! The config spells the stage as the integer 0-3 (serde reads and writes that integer, so resolved
//! configs and their hashes are unchanged); anything else is refused with one message.
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A ZeRO stage: how much of the training state is split across the data-parallel ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// 0: everything replicated; gradients all-reduced, every rank updates every parameter.
    #[default]
    Replicated,
    /// 1: the fp32 master weights and AdamW moments sharded; gradients reduce-scattered after the step.
    Optimizer,
    /// 2: also the gradients: each layer's reduce-scattered into this rank's shard during the backward.
    Gradients,
    /// 3: also the parameters: each layer gathered right before its forward and recompute, then freed.
    Parameters,
}

/// How the ranks' partial gradients are summed at the end of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradReduce {
    /// all-reduce of the full buffer: every rank gets every sum
    AllReduce,
    /// reduce-scatter of the full buffer in place: each rank's own range gets its sum
    ReduceScatterInPlace,
    /// nothing left to do: each group was reduce-scattered into the shard during the backward
    DoneInBackward,
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] =
        [ZeroStage::Replicated, ZeroStage::Optimizer, ZeroStage::Gradients, ZeroStage::Parameters];

    /// The stage of `dist.zero_stage = n`, or the one error message for any other number.
    pub fn from_number(n: u64) -> Result<ZeroStage, String> {
        match n {
            0 => Ok(ZeroStage::Replicated),
            1 => Ok(ZeroStage::Optimizer),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            _ => Err(format!(
                "dist.zero_stage = {n} is not a ZeRO stage\nhint: 0 (replicated), 1 (optimizer state sharded), \
                 2 (+ gradients), 3 (+ parameters)"
            )),
        }
    }

    /// The number the config spells (0-3).
    pub fn number(self) -> u8 {
        self as u8
    }

    /// Whether the optimizer state (fp32 master, m, v) is split over the ranks; otherwise every rank
    /// owns all of it (a one-owner shard map).
    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::Optimizer
    }

    /// How many ranks own optimizer shards in a world of `world` ranks (1: replicated).
    pub fn optimizer_owners(self, world: usize) -> usize {
        if self.shards_optimizer() {
            world
        } else {
            1
        }
    }

    /// Whether each rank keeps only its shard of the gradients (reduce-scattered per layer during the
    /// backward) instead of a full-length buffer.
    pub fn shards_gradients(self) -> bool {
        self >= ZeroStage::Gradients
    }

    /// Gradient elements this rank accumulates: its optimizer shard's, or all `total` of them.
    pub fn gradient_elems(self, total: usize, shard: usize) -> usize {
        if self.shards_gradients() {
            shard
        } else {
            total
        }
    }

    /// Whether parameters are sharded and gathered layer by layer around each use (the model holds no
    /// resident weights).
    pub fn gathers_weights(self) -> bool {
        self == ZeroStage::Parameters
    }

    /// Whether the updated master shards are all-gathered into every rank's resident weights after a step.
    pub fn publishes_weights(self) -> bool {
        !self.gathers_weights()
    }

    /// Whether a checkpoint or an evaluation must first gather the full weights (no rank holds them).
    pub fn needs_full_gather(self) -> bool {
        self.gathers_weights()
    }

    /// How a step's gradients are summed over the ranks.
    pub fn grad_reduce(self) -> GradReduce {
        match self {
            ZeroStage::Replicated => GradReduce::AllReduce,
            ZeroStage::Optimizer => GradReduce::ReduceScatterInPlace,
            ZeroStage::Gradients | ZeroStage::Parameters => GradReduce::DoneInBackward,
        }
    }

    /// `ZeRO-n`, as logs and the plan write it.
    pub fn label(self) -> String {
        format!("ZeRO-{}", self.number())
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl std::str::FromStr for ZeroStage {
    type Err = String;
    fn from_str(s: &str) -> Result<ZeroStage, String> {
        let n: u64 =
            s.trim().parse().map_err(|_| format!("dist.zero_stage = {s:?} is not a ZeRO stage\nhint: 0, 1, 2 or 3"))?;
        ZeroStage::from_number(n)
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ZeroStage, D::Error> {
        let n = i64::deserialize(d)?;
        let n = u64::try_from(n).map_err(|_| {
            serde::de::Error::custom(format!("dist.zero_stage = {n} is not a ZeRO stage\nhint: 0, 1, 2 or 3"))
        })?;
        ZeroStage::from_number(n).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_answers_its_rules() {
        use ZeroStage::*;
        let owners: Vec<usize> = ZeroStage::ALL.iter().map(|z| z.optimizer_owners(4)).collect();
        assert_eq!(owners, [1, 4, 4, 4]);
        let grads: Vec<usize> = ZeroStage::ALL.iter().map(|z| z.gradient_elems(100, 25)).collect();
        assert_eq!(grads, [100, 100, 25, 25]);
        assert_eq!(ZeroStage::ALL.map(|z| z.gathers_weights()), [false, false, false, true]);
        assert_eq!(ZeroStage::ALL.map(|z| z.publishes_weights()), [true, true, true, false]);
        assert_eq!(ZeroStage::ALL.map(|z| z.needs_full_gather()), [false, false, false, true]);
        assert_eq!(Replicated.grad_reduce(), GradReduce::AllReduce);
        assert_eq!(Optimizer.grad_reduce(), GradReduce::ReduceScatterInPlace);
        assert_eq!(Gradients.grad_reduce(), GradReduce::DoneInBackward);
        assert_eq!(Parameters.label(), "ZeRO-3");
    }

    #[test]
    fn the_config_spells_an_integer_and_anything_else_gets_one_message() {
        #[derive(Deserialize, Serialize)]
        struct D {
            zero_stage: ZeroStage,
        }
        for z in ZeroStage::ALL {
            let text = toml::to_string(&D { zero_stage: z }).unwrap();
            assert_eq!(text.trim(), format!("zero_stage = {}", z.number()));
            assert_eq!(toml::from_str::<D>(&text).unwrap().zero_stage, z);
            assert_eq!(z.number().to_string().parse::<ZeroStage>().unwrap(), z);
        }
        for bad in ["zero_stage = 4", "zero_stage = -1"] {
            let e = toml::from_str::<D>(bad).err().unwrap().to_string();
            assert!(e.contains("is not a ZeRO stage") && e.contains("hint:"), "{e}");
        }
        let e = "7".parse::<ZeroStage>().unwrap_err();
        assert!(e.contains("dist.zero_stage = 7 is not a ZeRO stage") && e.contains("hint:"), "{e}");
    }
}
