//! ZeRO ownership: which rank owns which (parameter, element range) slices of the flat parameter space,
//! and the one step that publishes an update: all-gather every rank's updated master slice, bucket by
//! bucket in the compute dtype, and write EVERY parameter into the model's `Var`s from it.
//!
//! Reference: Rajbhandari et al. 2020 (ZeRO stages 1-3), llm.c `llmc/zero.cuh` (shard = contiguous
//! slice of the flat buffer, a no-op at one process).
//! The non-obvious decisions: ownership is an explicit map (for each rank the list of parameter slices
//! it owns), built either by cutting the flat space into equal pieces that may split a parameter
//! (`Split::Slices`, ZeRO-1/2 balance) or by assigning whole parameters (`Split::WholeParams`, what a
//! ZeRO-3 gather per parameter wants); both keep a rank's slices consecutive in the flat space, so a
//! shard is one flat range and the collectives move contiguous blocks. The publish writes every
//! parameter from gathered values, never from a shard alone, so no weight can stay stale whatever the
//! cut (an earlier loop skipped parameters crossing a shard boundary); no rank holds a full fp32 copy
//! of the weights (4 B/param: 27 GB for Llama-2-7B), only one bucket in flight.
//! ZeRO-2 and 3 (`ZeroShards`) reduce-scatter each layer's gradients as soon as its backward is done
//! (in `dist.bucket_mb` rounds), so gradients exist only as each rank's shard; ZeRO-3 also keeps no full
//! weight buffer: each layer is gathered before its forward and again before its recompute.
//! Overlap (NCCL's stream, `Local`'s communication thread, `Comm::overlaps`): each group's gradient
//! reduce-scatter runs on during the backward of the groups before it, and ZeRO-3 starts the next
//! group's weight gather when it takes the current one; the thread ranks of the CPU tests run these
//! started paths for host shards too, so the tests prove the program NCCL runs.
//! What this file does not do: the collectives themselves (`Comm`).
use crate::comms::{Comm, Started};
use crate::flatbuf::FlatBuf;
use crate::model::layout::{ParamInfo, ParamLayout};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use std::cell::{Cell, RefCell};
use std::ops::Range;

/// How the flat parameter space is cut between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// equal contiguous pieces of the flat space (the last rank takes the remainder); may cut parameters
    Slices,
    /// whole parameters, consecutive ranks taking consecutive parameters of about equal total size
    WholeParams,
}

/// One piece of one parameter owned by a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlice {
    /// index into `ParamLayout::params`
    pub param: usize,
    /// element range inside the parameter
    pub elems: Range<usize>,
    /// the same elements in the flat space
    pub flat: Range<usize>,
}

/// For each rank, the parameter slices it owns (consecutive in the flat space).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMap {
    ranks: Vec<Vec<ParamSlice>>,
    ranges: Vec<Range<usize>>,
}

impl ShardMap {
    /// Ownership of `layout` by `world` ranks (`world >= 1`).
    pub fn new(layout: &ParamLayout, world: usize, split: Split) -> ShardMap {
        let world = world.max(1);
        let n = layout.total;
        let ranges: Vec<Range<usize>> = match split {
            Split::Slices => {
                let per = n.div_ceil(world);
                (0..world).map(|r| (r * per).min(n)..((r + 1) * per).min(n)).collect()
            }
            Split::WholeParams => {
                // a parameter goes to the rank its middle element falls into under an even cut: monotone
                // in the parameter index, so every rank gets a consecutive run of parameters
                let owner = |p: &crate::model::layout::ParamInfo| {
                    ((p.range.start + p.range.end) / 2 * world / n.max(1)).min(world - 1)
                };
                let mut start = 0;
                let mut ranges: Vec<Range<usize>> = (0..world)
                    .map(|r| {
                        let ends = layout.params.iter().filter(|p| owner(p) <= r).map(|p| p.range.end);
                        let end = ends.max().unwrap_or(0).max(start);
                        let range = start..end;
                        start = end;
                        range
                    })
                    .collect();
                ranges[world - 1].end = n;
                ranges
            }
        };
        let ranks = ranges
            .iter()
            .map(|r| {
                layout
                    .params
                    .iter()
                    .enumerate()
                    .filter_map(|(i, p)| {
                        let (lo, hi) = (p.range.start.max(r.start), p.range.end.min(r.end));
                        (lo < hi).then(|| ParamSlice {
                            param: i,
                            elems: lo - p.range.start..hi - p.range.start,
                            flat: lo..hi,
                        })
                    })
                    .collect()
            })
            .collect();
        ShardMap { ranks, ranges }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The slices `rank` owns, in flat order.
    pub fn slices(&self, rank: usize) -> &[ParamSlice] {
        &self.ranks[rank]
    }

    /// The flat range `rank` owns (its slices are consecutive).
    pub fn flat_range(&self, rank: usize) -> Range<usize> {
        self.ranges[rank].clone()
    }
}

/// Where gathered weights come from: every rank's fp32 master shard (`master`, this rank's; `map` says
/// who owns what) of the flat space of `layout`, exchanged over `comm`.
#[derive(Clone, Copy)]
pub struct Shards<'a> {
    pub comm: &'a Comm,
    pub map: &'a ShardMap,
    pub layout: &'a ParamLayout,
    pub master: &'a FlatBuf,
}

/// The ZeRO publish step after an update: every parameter all-gathered from the ranks' master
/// shards, bucket by bucket (`gather_groups`), in the compute dtype, straight into the model's `vars`
/// (layout order): every rank then computes with all the current weights, and none keeps a full fp32
/// copy beside them (the transient is one bucket; 4 B/param saved, 27 GB for Llama-2-7B). A
/// one-rank map (ZeRO-0: every rank owns the whole master) exchanges nothing.
pub fn publish(src: &Shards, vars: &[Var], bucket: usize) -> Result<()> {
    let layout = src.layout;
    let Some(first) = vars.first() else { bail!("internal: publishing into a model without parameters") };
    let (dtype, device) = (first.dtype(), first.device().clone());
    if vars.len() != layout.params.len() || vars.iter().any(|v| v.dtype() != dtype) {
        bail!(
            "internal: publishing {} parameters into {} vars of mixed or other dtypes",
            layout.params.len(),
            vars.len()
        );
    }
    if src.map.world() == 1 && matches!(src.master, FlatBuf::Host(_)) {
        // One rank owns the whole host master (ZeRO-0 on CPU): each parameter straight from it into its
        // var. The gather below would copy every value three more times (shard out, gather, bucket), which
        // at 25M parameters was ~5% of a CPU step (the test below checks both against one AdamW). The
        // parameters go on rayon's threads: one thread's copies were 2% of grid row 5's step (25.6M
        // parameters, 256 tokens), with the other thread idle.
        use rayon::prelude::*;
        let master = src.master;
        return layout.params.par_iter().zip(vars.par_iter()).try_for_each(|(p, v)| -> Result<()> {
            Ok(v.set(&master.param_tensor(p.range.clone(), &p.shape, dtype, &device)?)?)
        });
    }
    gather_groups(src, dtype, bucket, |group, gathering| {
        for (v, t) in vars[group.clone()].iter().zip(gathering.tensors(layout, group, dtype, &device)?) {
            v.set(&t)?;
        }
        Ok(())
    })
}

/// The per-group exchanges of ZeRO-2 and ZeRO-3. ZeRO-3 (parameters sharded): a rank keeps only its
/// fp32 master shard; a group of consecutive parameters (one decoder layer, or the embedding, the final
/// norm, the head) is all-gathered into compute-dtype `Var`s right before it is used and dropped
/// after. Both stages reduce-scatter the gradients the backward produced for a group at once, in
/// rounds of at most `bucket` elements (`dist.bucket_mb`), each rank adding its part into its gradient
/// shard, so no rank ever holds a full-length gradient buffer.
/// Every rank must call `gather` and `scatter_grads` for the same groups in the same order (the
/// training loop's control flow is the same on every rank); a missing gradient counts as zeros.
pub struct ZeroShards<'a> {
    pub comm: &'a Comm,
    pub map: &'a ShardMap,
    pub layout: &'a ParamLayout,
    /// this rank's fp32 master weights (`map.flat_range(rank)`)
    pub master: &'a FlatBuf,
    /// this rank's gradient shard (same range), accumulated over the step's micro-batches
    pub grads: &'a mut FlatBuf,
    pub dtype: DType,
    pub device: Device,
    /// gradient elements per reduce-scatter round (at least 1)
    pub bucket: usize,
    /// reduce-scatters still running (NCCL, `Local`) and where their results go in `grads`; joined and added
    /// when the next group is handed on or by `finish`
    pub pending: Vec<(Range<usize>, Started)>,
    /// ZeRO-3: start the next group's all-gather when the current one is taken (`gather`'s `next`)
    pub prefetch: bool,
    /// the group whose gather was started ahead, and its exchange
    prefetched: RefCell<Option<(Range<usize>, Gathering)>>,
    /// gathers started when their group was asked for (not ahead)
    cold: Cell<usize>,
}

/// One group's all-gather: complete (`Single`'s host shards) or started (every other case).
enum Gathering {
    /// the group's fp32 values (`Single`'s host shards)
    Host(FlatBuf),
    /// the gather of the group's values in the compute dtype
    Started(Started),
}

impl<'a> ZeroShards<'a> {
    /// ZeRO 2-3 exchanges of this rank: `prefetch` = whether the backend overlaps collectives with
    /// compute (NCCL, `Local`), the only case where starting the next group's gather early gains anything.
    /// `src`: where the weights come from; `grads`: this rank's gradient shard; weights are gathered
    /// in `dtype` onto `device`, gradients reduce-scattered in rounds of `bucket` elements.
    pub fn new(src: Shards<'a>, grads: &'a mut FlatBuf, dtype: DType, device: Device, bucket: usize) -> ZeroShards<'a> {
        let Shards { comm, map, layout, master } = src;
        let prefetch = comm.overlaps();
        ZeroShards {
            comm,
            map,
            layout,
            master,
            grads,
            dtype,
            device,
            bucket,
            pending: vec![],
            prefetch,
            prefetched: RefCell::new(None),
            cold: Cell::new(0),
        }
    }

    /// The parameters `params` gathered from every rank's shard, as `Var`s in the compute dtype.
    /// `next`: the group (and its label) the caller gathers after this one; with `prefetch` its
    /// all-gather starts now, so under NCCL it runs while this group's layer computes, and the next
    /// call finds it under way. Every rank passes the same `next` (same control flow), so the
    /// collectives stay in the same order everywhere.
    pub fn gather(&self, params: Range<usize>, label: &str, next: Option<(Range<usize>, &str)>) -> Result<Vec<Var>> {
        let taken = self.prefetched.borrow_mut().take();
        let gathering = match taken {
            Some((p, g)) if p == params => g,
            other => {
                drop(other); // a prefetch nobody asked for (not reached by the loops): joined, freed
                self.cold.set(self.cold.get() + 1);
                start_gather(&self.shards(), self.dtype, &params, label)?
            }
        };
        if let Some((n, l)) = next.filter(|_| self.prefetch) {
            let g = start_gather(&self.shards(), self.dtype, &n, l)?;
            *self.prefetched.borrow_mut() = Some((n, g));
        }
        Ok(gathering
            .tensors(self.layout, params, self.dtype, &self.device)?
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?)
    }

    /// Where this rank's gathers read from.
    fn shards(&self) -> Shards<'_> {
        Shards { comm: self.comm, map: self.map, layout: self.layout, master: self.master }
    }

    /// How many gathers started only when their group was asked for: with `prefetch` the first of a
    /// chain (each micro-batch's embedding, norm, head and first layer), without it every one.
    pub fn cold_gathers(&self) -> usize {
        self.cold.get()
    }

    /// Sum the gradients `store` holds for `vars` (the parameters `params`) over ranks, in rounds of
    /// at most `bucket` elements; add this rank's part into its gradient shard.
    pub fn scatter_grads(&mut self, params: Range<usize>, vars: &[Var], store: &GradStore, label: &str) -> Result<()> {
        // the previous group's exchange ran while this group's backward did; add its result now
        self.finish()?;
        let flat = flat_of(self.layout, &params);
        // the layer's full gradients where the shard lives (device memory under NCCL)
        let mut full = FlatBuf::zeros_in(flat.len(), &self.grads.placement())?;
        for (p, v) in self.layout.params[params].iter().zip(vars) {
            if let Some(g) = store.get(v.as_tensor()) {
                full.add_tensor(p.range.start - flat.start..p.range.end - flat.start, g)?;
            }
        }
        let me = self.comm.mesh().rank();
        let own = self.map.flat_range(me).start;
        for lo in (flat.start..flat.end).step_by(self.bucket.max(1)) {
            let round = lo..(lo + self.bucket.max(1)).min(flat.end);
            let parts = parts(self.map, &round);
            let counts: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            let (into, local) =
                (parts[me].start - own..parts[me].end - own, round.start - flat.start..round.end - flat.start);
            if let (FlatBuf::Host(v), false) = (&full, self.comm.overlaps()) {
                // host gradients of a backend that does not overlap (`Single`): host slices, no extra
                // copy; the readable reference of the started path below
                let mut mine = vec![0f32; counts[me]];
                self.comm.reduce_scatter_v_sum(&v[local], &mut mine, &counts, label)?;
                if !into.is_empty() {
                    let n = mine.len();
                    self.grads.add_tensor(into, &Tensor::from_vec(mine, n, &Device::Cpu)?)?;
                }
                continue;
            }
            let started = match &full {
                FlatBuf::Host(v) => self.comm.reduce_scatter_v_sum_host_start(v[local].to_vec(), &counts, label)?,
                FlatBuf::Device(_) => {
                    self.comm.reduce_scatter_v_sum_tensor_start(&full.range_tensor(local)?, &counts, label)?
                }
            };
            let ready = started.is_ready(); // `Single`: add it now
            self.pending.push((into, started));
            if ready {
                self.finish()?;
            }
        }
        Ok(())
    }

    /// Join the reduce-scatters still running and add their results into the gradient shard (in the
    /// order they were started: the same sums as joining each at once).
    pub fn finish(&mut self) -> Result<()> {
        for (into, started) in std::mem::take(&mut self.pending) {
            let mine = started.wait()?;
            if !into.is_empty() {
                self.grads.add_tensor(into, &mine)?;
            }
        }
        Ok(())
    }
}

/// Flat range of the consecutive parameters `params` (indices into the layout).
fn flat_of(layout: &ParamLayout, params: &Range<usize>) -> Range<usize> {
    layout.params[params.start].range.start..layout.params[params.end - 1].range.end
}

/// Per rank, the part of `flat` it owns (consecutive, covering `flat` in rank order).
fn parts(map: &ShardMap, flat: &Range<usize>) -> Vec<Range<usize>> {
    (0..map.world())
        .map(|r| {
            let o = map.flat_range(r);
            let (lo, hi) = (o.start.max(flat.start), o.end.min(flat.end));
            lo..hi.max(lo)
        })
        .collect()
}

/// Start the all-gather of the consecutive parameters `params` from every rank's `master` shard, sent
/// in the compute dtype (half the bytes of fp32 for bf16; rounding each shard before the gather equals
/// rounding after it) as a tensor where the shard lives. Under NCCL (its stream) and `Local` (the
/// rank's communication thread) the gather runs on while the compute goes on. Under `Single` a host
/// shard takes host slices (no extra copy; complete on return).
fn start_gather(src: &Shards, dtype: DType, params: &Range<usize>, label: &str) -> Result<Gathering> {
    let Shards { comm, map, layout, master } = *src;
    let flat = flat_of(layout, params);
    let parts = parts(map, &flat);
    let me = comm.mesh().rank();
    let own = map.flat_range(me).start;
    let counts: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    let mine = parts[me].start - own..parts[me].end - own;
    if let (FlatBuf::Host(_), false) = (master, comm.overlaps()) {
        // host shards of a backend that does not overlap (`Single`): f32 host slices, complete on
        // return; the readable reference of the started path below
        let mine = if mine.is_empty() { vec![] } else { master.range_to_host(mine)? };
        let mut full = vec![0f32; flat.len()];
        comm.all_gather_v(&mine, &mut full, &counts, label)?;
        return Ok(Gathering::Host(FlatBuf::from_vec(full)));
    }
    let mine = match mine.is_empty() {
        true => crate::device::zeros_1d(0, dtype, &master.device())?,
        false => master.range_tensor(mine)?.to_dtype(dtype)?,
    };
    Ok(Gathering::Started(comm.all_gather_v_tensor_start(&mine, &counts, label)?))
}

impl Gathering {
    /// The gathered parameters `params` as tensors of their shapes in `dtype` on `device`.
    fn tensors(self, layout: &ParamLayout, params: Range<usize>, dtype: DType, device: &Device) -> Result<Vec<Tensor>> {
        let flat = flat_of(layout, &params);
        let param = |p: &ParamInfo| p.range.start - flat.start..p.range.end - flat.start;
        match self {
            // `Single`'s host shards: the fp32 values, each parameter copied out in the compute dtype
            Gathering::Host(full) => {
                layout.params[params].iter().map(|p| full.param_tensor(param(p), &p.shape, dtype, device)).collect()
            }
            // started: already in the compute dtype; each parameter a view of the gathered buffer
            // (nothing updates it in place, so no copy on its own device)
            Gathering::Started(started) => {
                let full = started.wait()?; // (flat.len()) in the compute dtype
                layout.params[params]
                    .iter()
                    .map(|p| {
                        let r = param(p);
                        Ok(full.narrow(0, r.start, r.len())?.reshape(p.shape.as_slice())?.to_device(device)?)
                    })
                    .collect()
            }
        }
    }
}

/// Start the all-gather of every parameter from the ranks' master shards in groups of consecutive
/// whole parameters of at most `bucket` elements (a larger parameter alone), in the compute dtype,
/// one group at a time: `f(group, gathering)` takes each before the next starts. A one-rank map
/// (ZeRO-0's replicated master) needs no exchange: the values are this rank's own.
fn gather_groups(
    src: &Shards,
    dtype: DType,
    bucket: usize,
    mut f: impl FnMut(Range<usize>, Gathering) -> Result<()>,
) -> Result<()> {
    let layout = src.layout;
    let src = if src.map.world() == 1 { Shards { comm: &Comm::Single, ..*src } } else { *src };
    let mut lo = 0;
    while lo < layout.params.len() {
        let mut hi = lo + 1;
        let mut n = layout.params[lo].range.len();
        while hi < layout.params.len() && n + layout.params[hi].range.len() <= bucket.max(1) {
            n += layout.params[hi].range.len();
            hi += 1;
        }
        let label = format!("weights {}..", layout.params[lo].name);
        f(lo..hi, start_gather(&src, dtype, &(lo..hi), &label)?)?;
        lo = hi;
    }
    Ok(())
}

/// Every parameter gathered from the ranks' master shards (`gather_groups`), in the compute dtype;
/// `keep`: the device the ranks that want the weights get them on (under ZeRO-3 rank 0: the host for
/// a checkpoint, its device for an evaluation; every rank's device when a stage builds its model);
/// the other ranks only take part. The peak is one group's gathered buffer beside the kept tensors,
/// never a full fp32 copy of the model. Named tensors in layout order.
pub fn gather_params(
    src: &Shards,
    dtype: DType,
    bucket: usize,
    keep: Option<&Device>,
) -> Result<Vec<(String, Tensor)>> {
    let (layout, mut out) = (src.layout, vec![]);
    gather_groups(src, dtype, bucket, |group, g| {
        match keep {
            Some(dev) => {
                let names = layout.params[group.clone()].iter().map(|p| p.name.clone());
                out.extend(names.zip(g.tensors(layout, group, dtype, dev)?));
            }
            None => drop(g.tensors(layout, group, dtype, &src.master.device())?), // joined, then freed
        }
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw::{AdamW, AdamWHyper};
    use candle_core::{DType, Device, Tensor};

    /// Parameters of awkward (odd, prime, tiny) sizes.
    fn layout() -> ParamLayout {
        let shapes: [&[usize]; 7] = [&[7, 3], &[1], &[5], &[13, 1], &[2, 2, 3], &[1], &[11]];
        ParamLayout::new(
            &shapes.iter().enumerate().map(|(i, s)| (format!("p{i}.weight"), s.to_vec())).collect::<Vec<_>>(),
        )
    }

    /// `gather_params` over 3 thread ranks: rank 0 gets every parameter exactly (f32) or rounded as
    /// the compute weights are (bf16), named in layout order, on the device it asked for; the other
    /// ranks only take part; for host and device shards, for buckets from smaller than the largest
    /// parameter (it goes alone) to the whole model.
    #[test]
    fn gather_params_gives_rank_zero_every_weight_group_by_group() {
        use crate::comms::local::spawn_local;
        use crate::flatbuf::Placement;
        let l = layout();
        let full: Vec<f32> = (0..l.total).map(|i| (i as f32 * 0.37).sin() * 3.0 + 0.001 * i as f32).collect();
        let world = 3;
        let map = ShardMap::new(&l, world, Split::Slices);
        for dtype in [DType::F32, DType::BF16] {
            for placement in [Placement::Host, Placement::Device(Device::Cpu)] {
                for bucket in [1, 8, 30, l.total] {
                    let got = spawn_local(world, std::time::Duration::from_secs(20), |c| {
                        let comm = Comm::Local(c, 1);
                        let me = comm.mesh().rank();
                        let shard = FlatBuf::from_vec(full[map.flat_range(me)].to_vec()).placed(&placement)?;
                        let keep = (me == 0).then_some(&Device::Cpu);
                        gather_params(
                            &Shards { comm: &comm, map: &map, layout: &l, master: &shard },
                            dtype,
                            bucket,
                            keep,
                        )
                    })
                    .map_err(|e| e.to_string())
                    .unwrap();
                    let what = format!("{dtype:?} {placement:?} bucket {bucket}");
                    assert!(got[1].is_empty() && got[2].is_empty(), "{what}: only rank 0 keeps");
                    assert_eq!(got[0].len(), l.params.len(), "{what}");
                    for ((name, t), p) in got[0].iter().zip(&l.params) {
                        assert_eq!(name, &p.name, "{what}");
                        assert_eq!(t.dims(), p.shape.as_slice(), "{what} {name}");
                        assert_eq!(t.dtype(), dtype, "{what} {name}");
                        let want = Tensor::from_slice(&full[p.range.clone()], p.range.len(), &Device::Cpu)
                            .unwrap()
                            .to_dtype(dtype)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap();
                        let t = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                        assert_eq!(t, want, "{what} {name}");
                    }
                }
            }
        }
    }

    #[test]
    fn ownership_covers_every_element_exactly_once() {
        let l = layout();
        for split in [Split::Slices, Split::WholeParams] {
            for world in 1..=8 {
                let map = ShardMap::new(&l, world, split);
                assert_eq!(map.world(), world);
                let mut count = vec![0u32; l.total];
                for r in 0..world {
                    let range = map.flat_range(r);
                    let mut at = range.start;
                    for s in map.slices(r) {
                        // consecutive, inside the rank's range, and consistent with the parameter's place
                        assert_eq!(s.flat.start, at, "{split:?} world {world} rank {r}");
                        at = s.flat.end;
                        let p = &l.params[s.param];
                        assert_eq!(s.flat, p.range.start + s.elems.start..p.range.start + s.elems.end);
                        assert!(s.elems.end <= p.range.len() && !s.elems.is_empty());
                        if split == Split::WholeParams {
                            assert_eq!(s.elems, 0..p.range.len(), "{split:?} world {world}: {} is cut", p.name);
                        }
                        count[s.flat.clone()].iter_mut().for_each(|c| *c += 1);
                    }
                    assert_eq!(at, range.end.max(range.start));
                }
                assert!(count.iter().all(|&c| c == 1), "{split:?} world {world}: {count:?}");
            }
        }
        // whole-parameter ownership balances: with 2 ranks neither owns more than 2/3 of the 64 values
        let m = ShardMap::new(&l, 2, Split::WholeParams);
        assert!(m.flat_range(0).len() <= 43 && m.flat_range(1).len() <= 43, "{:?}", m);
    }

    /// `publish` after a sharded update, over real thread ranks: every rank's vars hold every
    /// parameter as one whole-model update gives it (no parameter stale whatever the cut), straight
    /// from the shards, for ZeRO-1/2 maps of 3 and 5 ranks and ZeRO-0's one-rank map (replicated
    /// master, no exchange), buckets from smaller than a parameter to the whole model, host and
    /// device shards.
    #[test]
    fn publish_after_a_sharded_update_writes_every_parameter_on_every_rank() {
        use crate::comms::local::spawn_local;
        use crate::flatbuf::Placement;
        let l = layout();
        let dev = Device::Cpu;
        let p0: Vec<f32> = (0..l.total).map(|i| 1.0 + i as f32 * 0.01).collect();
        let g = FlatBuf::from_vec((0..l.total).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.1 + 0.05).collect());
        let hp = AdamWHyper { beta1: 0.9, beta2: 0.95, eps: 1e-8, wd_matrix: 0.1, wd_embedding: 0.1, wd_norm: 0.0 };
        let init = FlatBuf::from_vec(p0.clone());
        let mut whole = AdamW::new(&l, &init, &ShardMap::new(&l, 1, Split::Slices), 0, hp).unwrap();
        whole.step(&g, 0.01).unwrap();
        let want = whole.master().host().unwrap().to_vec();
        for (world, owners) in [(3, 3), (5, 5), (3, 1)] {
            let map = ShardMap::new(&l, owners, Split::Slices);
            for placement in [Placement::Host, Placement::Device(Device::Cpu)] {
                for bucket in [2, 13, l.total] {
                    let what = format!("world {world} owners {owners} {placement:?} bucket {bucket}");
                    let got = spawn_local(world, std::time::Duration::from_secs(20), |c| {
                        let comm = Comm::Local(c, 1);
                        let me = if owners == 1 { 0 } else { comm.mesh().rank() };
                        let mut o = AdamW::new(&l, &init.try_clone()?.placed(&placement)?, &map, me, hp)?;
                        o.step(&g.try_clone()?.placed(&placement)?, 0.01)?;
                        let vars: Vec<Var> = l
                            .params
                            .iter()
                            .map(|p| {
                                Ok(Var::from_tensor(&Tensor::from_slice(
                                    &p0[p.range.clone()],
                                    p.shape.as_slice(),
                                    &dev,
                                )?)?)
                            })
                            .collect::<Result<_>>()?;
                        publish(&Shards { comm: &comm, map: &map, layout: &l, master: o.master() }, &vars, bucket)?;
                        vars.iter()
                            .map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
                            .collect::<Result<Vec<_>>>()
                    })
                    .map_err(|e| e.to_string())
                    .unwrap();
                    for (r, vars) in got.iter().enumerate() {
                        for (p, v) in l.params.iter().zip(vars) {
                            assert_eq!(v, &want[p.range.clone()], "{what} rank {r}: {}", p.name);
                            assert!(
                                v.iter().zip(&p0[p.range.clone()]).all(|(a, b)| a != b),
                                "{what}: {} stale",
                                p.name
                            );
                        }
                    }
                }
            }
        }
    }
}
