//! HF model directories: load and save `config.json` + safetensors (single file or sharded with
//! `model.safetensors.index.json`) + `tokenizer.json`, and random initialization from a config.
//!
//! Reference: HF `modeling_utils.save_pretrained` / `load_state_dict` layout and index format.
//! The non-obvious decision: files are memory-mapped and every tensor is checked (dtype, shape, the
//! shard the index names) with an error naming file and tensor; saving writes each file atomically
//! (temporary name, fsync, rename) and the index last, streaming every tensor from its device in
//! `STREAM_CHUNK_BYTES` pieces (`write_safetensors`: the crate's header, then the data piece by piece;
//! the bytes equal `safetensors::serialize`'s, which would hold the whole file in memory). Random
//! initialization draws one ChaCha8 stream per seed on the host, in parallel pieces (the stream is
//! seekable), and `init_flat` places each piece straight into the training state: the same bits on
//! every device and thread count, never the whole model in host memory. It is deliberately not
//! `Tensor::randn` on the GPU: curand's values differ from the CPU's, and the CPU-vs-GPU loss checks
//! (gpu-check.sh `train_parity`, selftest) start both runs from one seed's weights.
//! Not done here: optimizer state (`checkpoint`).
use crate::checksum::{FileSum, SumWriter};
use crate::flatbuf::{FlatBuf, Placement};
use crate::model::config::LlamaConfig;
use crate::model::layout::ParamLayout;
use crate::model::llama::{check_params, param_shapes, Llama};
use crate::util::{write_atomic, write_atomic_with};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Default largest shard written by `save_model_dir`: 5 GiB (5 x 2^30 bytes; harpe's byte sizes are
/// binary units everywhere, also `checkpoint.max_shard_bytes`' default and the GiB in messages).
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5 << 30;

fn st_dtype(d: safetensors::Dtype, file: &Path, name: &str) -> Result<DType> {
    Ok(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::F64 => DType::F64,
        other => bail!(
            "{}: tensor `{name}` has dtype {other:?}\nhint: harpe reads float32, bfloat16, float16 and float64 weights",
            file.display()
        ),
    })
}

/// Memory-map a safetensors file (read-only).
fn map_file(file: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(file)
        .with_context(|| format!("cannot open {}\nhint: is the model directory complete?", file.display()))?;
    // SAFETY: the file is opened read-only and not modified while mapped (a model directory is not
    // written by another process while we load it).
    unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("cannot map {}", file.display()))
}

fn parse<'a>(mmap: &'a memmap2::Mmap, file: &Path) -> Result<safetensors::SafeTensors<'a>> {
    safetensors::SafeTensors::deserialize(mmap).map_err(|e| {
        anyhow!(
            "{}: not a valid safetensors file: {e}\nhint: the file is truncated or corrupt; re-download or re-save it",
            file.display()
        )
    })
}

/// Every tensor of one safetensors file, one at a time: `f(name, tensor)` gets it in the file's dtype
/// on `device`, made straight from the memory map (one host-to-device copy on a GPU; a host copy on the
/// CPU, or first when the data is misaligned); right after, that tensor's pages are dropped from this
/// process (`madvise(MADV_DONTNEED)`: the file stays in the page cache, but the process's resident memory
/// does not grow with the file), so host memory holds about one tensor beyond what `f` keeps.
pub fn visit_safetensors(file: &Path, device: &Device, mut f: impl FnMut(String, Tensor) -> Result<()>) -> Result<()> {
    let mmap = map_file(file)?;
    let st = parse(&mmap, file)?;
    let page = 4096usize;
    for (name, view) in st.tensors() {
        let dt = st_dtype(view.dtype(), file, &name)?;
        let data = view.data();
        let t = Tensor::from_raw_buffer(data, dt, view.shape(), device)
            .with_context(|| format!("{}: cannot read tensor `{name}`", file.display()))?;
        let start = (data.as_ptr() as usize - mmap.as_ptr() as usize) / page * page;
        let end = (data.as_ptr() as usize - mmap.as_ptr() as usize + data.len()).min(mmap.len());
        #[cfg(unix)]
        // SAFETY: DONTNEED on a private read-only file mapping only drops the process's copies of the
        // pages; a later read faults them in again from the file. No reference into these pages is held
        // (the tensor owns a copy; `data` is not used again).
        unsafe {
            let _ = mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start);
        }
        f(name, t)?;
    }
    Ok(())
}

/// Read every tensor of one safetensors file, converted to `dtype` on `device`.
pub fn read_safetensors(file: &Path, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    collect_as(dtype, |f| visit_safetensors(file, device, f))
}

/// The callback a visitor (`visit_safetensors`, `visit_model_tensors`) hands each tensor to.
type Visit<'a> = &'a mut dyn FnMut(String, Tensor) -> Result<()>;

/// Every tensor `visit` hands out, converted to `dtype`.
fn collect_as(dtype: DType, visit: impl FnOnce(Visit) -> Result<()>) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    visit(&mut |name, t| {
        out.insert(name, t.to_dtype(dtype)?);
        Ok(())
    })?;
    Ok(out)
}

/// Names and shapes of every tensor of a model directory, from the safetensors headers only (no data
/// is read), in file order.
pub fn tensor_shapes(dir: &Path) -> Result<Vec<(String, Vec<usize>)>> {
    let (files, _) = weight_files(dir)?;
    let mut out = vec![];
    for f in &files {
        let mmap = map_file(f)?;
        out.extend(parse(&mmap, f)?.tensors().into_iter().map(|(n, v)| (n, v.shape().to_vec())));
    }
    Ok(out)
}

/// Tensor name -> shard file name, as in `model.safetensors.index.json`.
pub type WeightMap = BTreeMap<String, String>;

/// The weight files of a model directory: single `model.safetensors` or an index with shards.
pub fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>)> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{}: malformed JSON at line {} column {}: {e}\nhint: fix or regenerate the index",
                index.display(),
                e.line(),
                e.column()
            )
        })?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
            anyhow!(
                "{}: missing object `weight_map`\nhint: an HF index maps tensor names to shard files",
                index.display()
            )
        })?;
        let mut wm = BTreeMap::new();
        for (k, f) in map {
            let f = f.as_str().ok_or_else(|| {
                anyhow!("{}: `weight_map.{k}` must be a file name\nhint: fix the index", index.display())
            })?;
            wm.insert(k.clone(), f.to_string());
        }
        let mut files: Vec<String> = wm.values().cloned().collect();
        files.sort();
        files.dedup();
        let mut paths = vec![];
        for f in files {
            let p = dir.join(&f);
            if !p.exists() {
                bail!(
                    "{}: shard `{f}` named in the index is missing\nhint: download or copy every shard",
                    index.display()
                );
            }
            paths.push(p);
        }
        return Ok((paths, Some(wm)));
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok((vec![single], None));
    }
    bail!(
        "{}: no model.safetensors and no model.safetensors.index.json\nhint: harpe reads HF safetensors checkpoints (convert .bin with transformers' save_pretrained(safe_serialization=True))",
        dir.display()
    )
}

/// Visit every tensor of a model directory one at a time (`visit_safetensors`, file after file) as
/// `f(name, tensor in the file's dtype on device)`, checking that each lives in the shard the index
/// names, appears once, and that no tensor of the index is missing.
pub fn visit_model_tensors(dir: &Path, device: &Device, mut f: impl FnMut(String, Tensor) -> Result<()>) -> Result<()> {
    let (files, index) = weight_files(dir)?;
    let mut seen = std::collections::HashSet::new();
    for file in &files {
        let fname = file.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        visit_safetensors(file, device, |name, t| {
            if let Some(wm) = &index {
                match wm.get(&name) {
                    Some(expected) if *expected == fname => {}
                    Some(expected) => bail!(
                        "{}: tensor `{name}` is in {fname} but the index says {expected}\nhint: regenerate the index",
                        dir.display()
                    ),
                    None => bail!(
                        "{}: tensor `{name}` in {fname} is not in model.safetensors.index.json\nhint: regenerate the index",
                        dir.display()
                    ),
                }
            }
            if !seen.insert(name.clone()) {
                bail!("{}: tensor `{name}` appears in two shards\nhint: the checkpoint is inconsistent", dir.display());
            }
            f(name, t)
        })?;
    }
    if let Some(wm) = &index {
        if let Some(missing) = wm.keys().find(|k| !seen.contains(*k)) {
            bail!(
                "{}: tensor `{missing}` is in the index but not in shard {}\nhint: a shard is truncated or from another checkpoint",
                dir.display(),
                wm[missing]
            );
        }
    }
    Ok(())
}

/// Load all tensors of a model directory in `dtype` on `device` (`visit_model_tensors`' checks).
pub fn load_tensors(dir: &Path, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    collect_as(dtype, |f| visit_model_tensors(dir, device, f))
}

/// The training state's fp32 weights of a model directory, streamed into one flat buffer with
/// placement `p` (on a GPU: the device) one tensor at a time, so host memory stays far below the model
/// size: names and shapes are checked from the headers first (`llama::check_params`, the rules of
/// `Llama::from_tensors`), then each tensor goes from the memory map to the device and into its range.
pub fn load_flat(dir: &Path, cfg: &LlamaConfig, p: &Placement) -> Result<(ParamLayout, FlatBuf)> {
    let origin = dir.display().to_string();
    check_params(cfg, &tensor_shapes(dir)?, &origin)?;
    let layout = ParamLayout::new(&param_shapes(cfg));
    let place: HashMap<&str, std::ops::Range<usize>> =
        layout.params.iter().map(|q| (q.name.as_str(), q.range.clone())).collect();
    let mut flat = FlatBuf::zeros_in(layout.total, p)?;
    visit_model_tensors(dir, &p.device(), |name, t| match place.get(name.as_str()) {
        Some(r) => flat.set_tensor(r.clone(), &t).with_context(|| format!("{origin}: tensor `{name}`")),
        None => Ok(()), // a tied head or a rotary table: `check_params` allowed it, training does not use it
    })?;
    Ok((layout, flat))
}

/// Load a model directory (config.json + safetensors) as a `Llama` in `dtype` on `device`.
pub fn load_model_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Llama> {
    if !dir.is_dir() {
        bail!(
            "{}: not a directory\nhint: pass an HF model directory (config.json, *.safetensors, tokenizer.json)",
            dir.display()
        );
    }
    let cfg = LlamaConfig::from_file(&dir.join("config.json"))?;
    let tensors = load_tensors(dir, dtype, device)?;
    Llama::from_tensors(cfg, tensors, &dir.display().to_string())
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// The files a save wrote, by name, with their block checksums (a checkpoint's `checksums.json`).
pub type WrittenFiles = Vec<(String, FileSum)>;

/// Write config.json and the tensors (HF names) as `model.safetensors`, or as shards of at most
/// `max_shard_bytes` plus `model.safetensors.index.json` when larger. Files are written atomically;
/// returns each file's checksums, computed as it was written.
pub fn save_model_dir(
    dir: &Path,
    cfg: &LlamaConfig,
    tensors: &[(String, Tensor)],
    max_shard_bytes: usize,
) -> Result<WrittenFiles> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create {}\nhint: check the path and permissions", dir.display()))?;
    let mut cfg = cfg.clone();
    if let Some((_, t)) = tensors.first() {
        cfg.torch_dtype = Some(dtype_name(t.dtype()).to_string());
    }
    let cfg_text = serde_json::to_string_pretty(&cfg.to_json())?;
    write_atomic(&dir.join("config.json"), cfg_text.as_bytes())?;
    let mut written = vec![("config.json".to_string(), FileSum::of_bytes(cfg_text.as_bytes()))];
    // Group tensors into shards in order.
    let mut shards: Vec<Vec<&(String, Tensor)>> = vec![vec![]];
    let mut cur = 0usize;
    let mut total = 0usize;
    for nt in tensors {
        let bytes = nt.1.elem_count() * nt.1.dtype().size_in_bytes();
        total += bytes;
        if cur > 0 && cur + bytes > max_shard_bytes {
            shards.push(vec![]);
            cur = 0;
        }
        cur += bytes;
        if let Some(last) = shards.last_mut() {
            last.push(nt);
        }
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let fname = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let srcs: Vec<(String, StreamSrc)> = shard.iter().map(|(k, t)| (k.clone(), StreamSrc::Tensor(t))).collect();
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let (_, sum) = write_safetensors_summed(&dir.join(&fname), &srcs, Some(meta), STREAM_CHUNK_BYTES)?;
        written.push((fname.clone(), sum));
        for (k, _) in shard {
            weight_map.insert(k.clone(), fname.clone());
        }
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&index)?;
        write_atomic(&dir.join("model.safetensors.index.json"), text.as_bytes())?;
        written.push(("model.safetensors.index.json".to_string(), FileSum::of_bytes(text.as_bytes())));
        let _ = std::fs::remove_file(dir.join("model.safetensors"));
    } else {
        let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    }
    Ok(written)
}

/// Bytes per piece of a streamed safetensors write (`write_safetensors`): a save holds about this much
/// host memory per file (the piece's values and their bytes) whatever the tensors' sizes.
pub const STREAM_CHUNK_BYTES: usize = 32 << 20;

/// Where the values of one tensor of a streamed safetensors file come from.
pub enum StreamSrc<'a> {
    /// a float tensor on any device (a model weight)
    Tensor(&'a Tensor),
    /// a flat fp32 buffer on the host or a device (optimizer state), saved 1-D
    Flat(&'a FlatBuf),
}

impl StreamSrc<'_> {
    fn dtype(&self) -> DType {
        match self {
            StreamSrc::Tensor(t) => t.dtype(),
            StreamSrc::Flat(_) => DType::F32,
        }
    }

    fn shape(&self) -> Vec<usize> {
        match self {
            StreamSrc::Tensor(t) => t.dims().to_vec(),
            StreamSrc::Flat(b) => vec![b.len()],
        }
    }

    /// Little-endian bytes of the elements `range` (row-major order), copied from the device.
    fn bytes(&self, range: std::ops::Range<usize>) -> Result<Vec<u8>> {
        // generic over the conversion, not a `fn` pointer: through a pointer each element was an indirect
        // call (benches/results/checkpoint-checksums.md), where each `to_le_bytes` inlines to a copy
        fn le<T: Copy, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            v.into_iter().flat_map(f).collect()
        }
        let t = match self {
            StreamSrc::Flat(b) => return Ok(le(b.range_to_host(range)?, f32::to_le_bytes)),
            StreamSrc::Tensor(t) => t.flatten_all()?.narrow(0, range.start, range.len())?,
        };
        Ok(match t.dtype() {
            DType::F32 => le(t.to_vec1::<f32>()?, f32::to_le_bytes),
            DType::BF16 => le(t.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
            DType::F16 => le(t.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
            DType::F64 => le(t.to_vec1::<f64>()?, f64::to_le_bytes),
            other => bail!("cannot save a tensor of dtype {other:?}\nhint: save float weights"),
        })
    }
}

/// Write `tensors` as the safetensors file `path`, atomically (temporary name, fsync, rename), copying
/// each tensor from its device in pieces of at most `chunk_bytes`; the bytes are exactly those of
/// `safetensors::serialize` (header from the crate's `Metadata`: tensors sorted by descending dtype,
/// then name, padded with spaces to 8 bytes). Returns the largest piece held on the host.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, StreamSrc)],
    meta: Option<HashMap<String, String>>,
    chunk_bytes: usize,
) -> Result<usize> {
    Ok(write_safetensors_summed(path, tensors, meta, chunk_bytes)?.0)
}

/// `write_safetensors`, also returning the file's block checksums, computed from the bytes as they are
/// written (`checksum::SumWriter`), not by reading the file back.
pub fn write_safetensors_summed(
    path: &Path,
    tensors: &[(String, StreamSrc)],
    meta: Option<HashMap<String, String>>,
    chunk_bytes: usize,
) -> Result<(usize, FileSum)> {
    let mut order: Vec<(&String, &StreamSrc, safetensors::Dtype)> =
        tensors.iter().map(|(k, s)| Ok((k, s, safe_dtype(s.dtype())?))).collect::<Result<_>>()?;
    order.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for &(name, src, dtype) in &order {
        let shape = src.shape();
        let n = shape.iter().product::<usize>() * src.dtype().size_in_bytes();
        infos
            .push((name.clone(), safetensors::tensor::TensorInfo { dtype, shape, data_offsets: (offset, offset + n) }));
        offset += n;
    }
    let header = safetensors::tensor::Metadata::new(meta, infos)
        .map_err(|e| anyhow!("cannot describe {}: {e}", path.display()))?;
    let mut header = serde_json::to_string(&header)?.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut largest = 0;
    let mut sum = None;
    write_atomic_with(path, |f| {
        let mut f = std::io::BufWriter::new(SumWriter::new(f));
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(&header)?;
        for &(_, src, _) in &order {
            let (n, size) = (src.shape().iter().product::<usize>(), src.dtype().size_in_bytes());
            let step = (chunk_bytes / size).max(1);
            for start in (0..n).step_by(step) {
                let piece = src.bytes(start..(start + step).min(n))?;
                largest = largest.max(piece.len());
                f.write_all(&piece)?;
            }
        }
        let summed = f.into_inner().map_err(|e| e.into_error())?;
        sum = Some(summed.finish().1);
        Ok(())
    })?;
    let sum = sum.ok_or_else(|| anyhow!("internal: {} was written without its checksums", path.display()))?;
    Ok((largest, sum))
}

fn safe_dtype(d: DType) -> Result<safetensors::Dtype> {
    Ok(match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::F64 => safetensors::Dtype::F64,
        other => bail!("cannot save a tensor of dtype {other:?}\nhint: save float weights"),
    })
}

/// A tensor's little-endian bytes, whole, as a safetensors view: the reference `write_safetensors`
/// is tested against (`safetensors::serialize`), and test fixtures.
pub struct TensorBytes {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl TensorBytes {
    /// The bytes of a float tensor.
    pub fn from_tensor(t: &Tensor) -> Result<TensorBytes> {
        let t = t.contiguous()?;
        let flat = t.flatten_all()?;
        let (dtype, data): (_, Vec<u8>) = match t.dtype() {
            DType::F32 => {
                (safetensors::Dtype::F32, flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::BF16 => {
                (safetensors::Dtype::BF16, flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::F16 => {
                (safetensors::Dtype::F16, flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::F64 => {
                (safetensors::Dtype::F64, flat.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            other => bail!("cannot save a tensor of dtype {other:?}\nhint: save float weights"),
        };
        Ok(TensorBytes { dtype, shape: t.dims().to_vec(), data })
    }

    /// A 1-D f32 buffer.
    pub fn from_f32(v: &[f32]) -> TensorBytes {
        TensorBytes {
            dtype: safetensors::Dtype::F32,
            shape: vec![v.len()],
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

impl safetensors::View for &TensorBytes {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Values per piece of the random initialization: generated in parallel, then placed one piece at a time.
const INIT_PIECE: usize = 1 << 20;

/// HF-style random initialization: normal(0, initializer_range) for matrices, ones for norms.
/// Deterministic from `seed` (ChaCha, Box-Muller), independent of thread count and device.
pub fn init_random(cfg: &LlamaConfig, seed: u64, dtype: DType, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    let mut data = vec![];
    init_pieces(cfg, seed, |name, shape, start, piece| {
        data.extend_from_slice(&piece);
        if start + piece.len() == shape.iter().product::<usize>() {
            let t = Tensor::from_vec(std::mem::take(&mut data), shape, device)?.to_dtype(dtype)?;
            out.push((name.to_string(), t));
        }
        Ok(())
    })?;
    Ok(out)
}

/// `init_random`'s fp32 values (the same bits for a seed) written straight into a flat buffer with
/// placement `p`, piece by piece: host memory stays a few pieces per thread whatever the model size.
pub fn init_flat(cfg: &LlamaConfig, seed: u64, p: &Placement) -> Result<(ParamLayout, FlatBuf)> {
    let layout = ParamLayout::new(&param_shapes(cfg));
    let mut flat = FlatBuf::zeros_in(layout.total, p)?;
    let mut params = layout.params.iter();
    let mut range = 0..0;
    init_pieces(cfg, seed, |name, _, start, piece| {
        if start == 0 {
            range = params.next().filter(|q| q.name == name).map(|q| q.range.clone()).ok_or_else(|| {
                anyhow!("internal: the random initialization's parameter {name} is not the layout's next")
            })?;
        }
        let at = range.start + start;
        let n = piece.len();
        flat.set_tensor(at..at + n, &Tensor::from_vec(piece, n, &Device::Cpu)?)
    })?;
    Ok((layout, flat))
}

/// The random initialization as pieces: `f(name, shape, first element, values)` for every parameter
/// in HF order, each in order of its elements. The values are those of one ChaCha8 stream from `seed`
/// drawn in that order (two words per normal matrix element: u1, u2 of Box-Muller; none for norms).
/// ChaCha is seekable, so each piece starts its own generator at its word position and the pieces of
/// a batch are drawn in parallel, with the bits of the one sequential stream.
fn init_pieces(
    cfg: &LlamaConfig,
    seed: u64,
    mut f: impl FnMut(&str, &[usize], usize, Vec<f32>) -> Result<()>,
) -> Result<()> {
    use rayon::prelude::*;
    let std = cfg.initializer_range as f32;
    let batch = INIT_PIECE * rayon::current_num_threads();
    let mut word = 0u128; // stream position (32-bit words) of the next normal parameter
    for (name, shape) in param_shapes(cfg) {
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        if n == 0 {
            f(&name, &shape, 0, vec![])?; // an empty parameter is still one (empty) piece
        }
        for b in (0..n).step_by(batch) {
            let starts: Vec<usize> = (b..(b + batch).min(n)).step_by(INIT_PIECE).collect();
            let pieces: Vec<Vec<f32>> = starts
                .par_iter()
                .map(|&s| {
                    let len = INIT_PIECE.min(n - s);
                    if norm {
                        return vec![1.0; len];
                    }
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
                    rng.set_word_pos(word + 2 * s as u128);
                    (0..len)
                        .map(|_| {
                            let u1: f32 = rng.random::<f32>().max(1e-12);
                            let u2: f32 = rng.random::<f32>();
                            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                        })
                        .collect()
                })
                .collect();
            for (s, piece) in starts.into_iter().zip(pieces) {
                f(&name, &shape, s, piece)?;
            }
        }
        if !norm {
            word += 2 * n as u128;
        }
    }
    Ok(())
}
