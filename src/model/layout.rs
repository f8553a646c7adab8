//! Where every parameter of a Llama lives in the flat fp32 vectors (master, m, v, gradients): HF names in
//! order, shapes, ranges, and each parameter's weight-decay group.
//!
//! The non-obvious decision: the layout belongs to the model (its names and the norm rule), below the
//! gradient buffers, the optimizer and the ZeRO shards that index by it; `grads` re-exports it.
use std::ops::Range;

/// Parameter groups for per-group weight decay (a closed set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGroup {
    /// 2-D projection matrices and the untied LM head
    Matrix,
    /// the token embedding
    Embedding,
    /// RMSNorm weights
    Norm,
}

impl ParamGroup {
    /// Group of an HF Llama parameter name.
    pub fn of(name: &str) -> ParamGroup {
        if super::llama::is_norm_param(name) {
            ParamGroup::Norm
        } else if name.contains("embed_tokens") {
            ParamGroup::Embedding
        } else {
            ParamGroup::Matrix
        }
    }
}

/// One parameter's place in the flat vector.
#[derive(Clone, Debug)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    pub group: ParamGroup,
}

/// Where every parameter lives in the flat fp32 vectors (master, m, v, grads).
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub params: Vec<ParamInfo>,
    pub total: usize,
}

impl ParamLayout {
    /// Lay out parameters in the given order.
    pub fn new(names_shapes: &[(String, Vec<usize>)]) -> ParamLayout {
        let mut off = 0;
        let params = names_shapes
            .iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                let p = ParamInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    range: off..off + n,
                    group: ParamGroup::of(name),
                };
                off += n;
                p
            })
            .collect();
        ParamLayout { params, total: off }
    }
}
