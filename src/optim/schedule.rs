//! Learning-rate schedules: constant, linear warm-up then constant, linear warm-up then cosine decay.
//!
//! Reference: nanoGPT `get_lr` (warm-up + cosine to a floor). The non-obvious decision: the schedule is
//! evaluated per stage with the stage's own peak lr and step count, so a multi-stage run (HARPE §4.1,
//! constant lr 2e-5) does not re-warm unless the stage asks for it. Warm-up step `s` (0-based) uses
//! `lr * (s + 1) / warmup` so the first step is never a no-op. Not done here: per-group lr.

pub use crate::config::ScheduleKind;
use crate::config::ScheduleSection;

/// A schedule with its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
}

impl ScheduleSection {
    /// `[schedule]` as a `Schedule` (here, not in config: config names no module above it).
    pub fn schedule(&self) -> Schedule {
        Schedule { kind: self.kind, warmup_steps: self.warmup_steps, min_lr_ratio: self.min_lr_ratio }
    }
}

impl Schedule {
    /// Learning rate for 0-based `step` of a stage of `total` steps with peak `lr`.
    pub fn lr_at(&self, lr: f64, step: u64, total: u64) -> f64 {
        let warm = self.warmup_steps;
        match self.kind {
            ScheduleKind::Constant => lr,
            ScheduleKind::LinearWarmup | ScheduleKind::Cosine if step < warm => lr * (step + 1) as f64 / warm as f64,
            ScheduleKind::LinearWarmup => lr,
            ScheduleKind::Cosine => {
                let span = total.saturating_sub(warm).saturating_sub(1).max(1);
                let progress = ((step - warm) as f64 / span as f64).min(1.0);
                let min = lr * self.min_lr_ratio;
                min + (lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let c = Schedule { kind: ScheduleKind::Constant, warmup_steps: 10, min_lr_ratio: 0.1 };
        assert_eq!(c.lr_at(2e-5, 0, 100), 2e-5);
        let w = Schedule { kind: ScheduleKind::LinearWarmup, ..c };
        assert!((w.lr_at(1.0, 0, 100) - 0.1).abs() < 1e-12);
        assert!((w.lr_at(1.0, 4, 100) - 0.5).abs() < 1e-12);
        assert_eq!(w.lr_at(1.0, 50, 100), 1.0);
        let k = Schedule { kind: ScheduleKind::Cosine, ..c };
        assert!((k.lr_at(1.0, 10, 111) - 1.0).abs() < 1e-12);
        assert!((k.lr_at(1.0, 60, 111) - 0.55).abs() < 1e-12);
        assert!((k.lr_at(1.0, 110, 111) - 0.1).abs() < 1e-12);
        assert!(k.lr_at(1.0, 30, 111) > k.lr_at(1.0, 31, 111));
    }
}
