//! What `Local`'s collectives move and how they reduce it: the element types (`Elem`: f32, f64, bf16,
//! f16; 16-bit sums accumulate in f32 and round once) and `ReduceOp`. Apart from the exchange round
//! (`round.rs`) because a type added here changes nothing there.
use candle_core::DType;
use half::{bf16, f16};

/// Element types the collectives move; sums accumulate in `Acc` (f32 for bf16 and f16) in rank order.
pub trait Elem: Copy + Send + Sync + 'static {
    /// Accumulator type of a reduction.
    type Acc: Copy;
    /// The tensor dtype of this element type (the collective signature names it).
    const DTYPE: DType;
    /// Widen to the accumulator.
    fn acc(self) -> Self::Acc;
    /// `a + b` in the accumulator.
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a / n` in the accumulator (for `ReduceOp::Avg`).
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
    /// Round the accumulator back to the element type.
    fn finish(a: Self::Acc) -> Self;
}

/// An element type summed in its own precision (`Acc = Self`).
macro_rules! full_elem {
    ($t:ty, $dtype:expr) => {
        impl Elem for $t {
            type Acc = $t;
            const DTYPE: DType = $dtype;
            fn acc(self) -> $t {
                self
            }
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            fn div(a: $t, n: usize) -> $t {
                a / n as $t
            }
            fn finish(a: $t) -> $t {
                a
            }
        }
    };
}
full_elem!(f32, DType::F32);
full_elem!(f64, DType::F64);

/// The 16-bit element types: summed in f32, rounded once at the end.
macro_rules! half_elem {
    ($t:ty, $dtype:expr) => {
        impl Elem for $t {
            type Acc = f32;
            const DTYPE: DType = $dtype;
            fn acc(self) -> f32 {
                self.to_f32()
            }
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            fn div(a: f32, n: usize) -> f32 {
                a / n as f32
            }
            fn finish(a: f32) -> $t {
                <$t>::from_f32(a)
            }
        }
    };
}
half_elem!(bf16, DType::BF16);
half_elem!(f16, DType::F16);

/// Reduction of all_reduce / reduce_scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks, in rank order.
    Sum,
    /// Sum over ranks in rank order, then divide by the world size.
    Avg,
}
