//! HF model directories: load and save `config.json` + safetensors (single file or sharded with
//! `model.safetensors.index.json`) + `tokenizer.json`, and random initialization from a config.
//!
//! Reference: HF `modeling_utils.save_pretrained` / `load_state_dict` layout and index format.
//! The non-obvious decision: files are memory-mapped and every tensor is checked (dtype, shape, the
//! shard the index names) with an error naming file and tensor; saving writes each file atomically
//! (temporary name, fsync, rename) and the index last. Not done here: optimizer state (`checkpoint`).
use crate::flatbuf::{FlatBuf, Placement};
use crate::grads::ParamLayout;
use crate::model::config::LlamaConfig;
use crate::model::llama::{check_params, param_shapes, Llama};
use crate::util::write_atomic;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
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
    let mut out = HashMap::new();
    visit_safetensors(file, device, |name, t| {
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
    let mut all = HashMap::new();
    visit_model_tensors(dir, device, |name, t| {
        all.insert(name, t.to_dtype(dtype)?);
        Ok(())
    })?;
    Ok(all)
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

/// Write config.json and the tensors (HF names) as `model.safetensors`, or as shards of at most
/// `max_shard_bytes` plus `model.safetensors.index.json` when larger. Files are written atomically.
pub fn save_model_dir(
    dir: &Path,
    cfg: &LlamaConfig,
    tensors: &[(String, Tensor)],
    max_shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create {}\nhint: check the path and permissions", dir.display()))?;
    let mut cfg = cfg.clone();
    if let Some((_, t)) = tensors.first() {
        cfg.torch_dtype = Some(dtype_name(t.dtype()).to_string());
    }
    let cfg_text = serde_json::to_string_pretty(&cfg.to_json())?;
    write_atomic(&dir.join("config.json"), cfg_text.as_bytes())?;
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
        let views =
            shard.iter().map(|(k, t)| Ok((k.clone(), TensorBytes::from_tensor(t)?))).collect::<Result<Vec<_>>>()?;
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let bytes = safetensors::tensor::serialize(views.iter().map(|(k, v)| (k.clone(), v)), Some(meta))
            .map_err(|e| anyhow!("cannot serialize {fname}: {e}"))?;
        write_atomic(&dir.join(&fname), &bytes)?;
        for (k, _) in shard {
            weight_map.insert(k.clone(), fname.clone());
        }
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(&dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)?.as_bytes())?;
        let _ = std::fs::remove_file(dir.join("model.safetensors"));
    } else {
        let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    }
    Ok(())
}

/// A tensor's little-endian bytes as a safetensors view (also used for optimizer state).
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

/// HF-style random initialization: normal(0, initializer_range) for matrices, ones for norms.
/// Deterministic from `seed` (ChaCha, Box-Muller), independent of thread count.
pub fn init_random(cfg: &LlamaConfig, seed: u64, dtype: DType, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let std = cfg.initializer_range as f32;
    let mut out = vec![];
    for (name, shape) in param_shapes(cfg) {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else {
            (0..n)
                .map(|_| {
                    let u1: f32 = rng.random::<f32>().max(1e-12);
                    let u2: f32 = rng.random::<f32>();
                    std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                })
                .collect()
        };
        out.push((name, Tensor::from_vec(data, shape, device)?.to_dtype(dtype)?));
    }
    Ok(out)
}
