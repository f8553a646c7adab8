//! The binary needs no system library beyond glibc's and libgcc/libstdc++ (a GPU image with only
//! the NVIDIA stack and torch must be able to start it), and the plots still have text (drawn with the
//! font embedded by src/plot_font.rs, not a system font).
//!
//! Which binary: `cargo test` builds the debug `harpe` (env!("CARGO_BIN_EXE_harpe")), not the release one.
//! That is honest for this question: a binary's NEEDED entries come from the crates' link directives
//! (`cargo:rustc-link-lib`, `#[link]`) and the Rust standard library, which depend on the features, not on
//! the profile's optimisation level; the release build links the same crates with the same features.
//! The shipped binary itself is checked again by `scripts/gpu-check.sh build` (its allow list adds the
//! CUDA/NCCL libraries) before it is packed.
//! Does not: check a CUDA build (that needs the CUDA toolchain; gpu-check.sh build does it).
use std::path::Path;
use std::process::Command;

/// glibc's libraries, the dynamic loader, libgcc_s and libstdc++.
const ALLOWED: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libutil.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
    "libgcc_s.so.1",
    "libstdc++.so.6",
];

/// The NEEDED entries of an ELF file, by `readelf -d` (binutils, present wherever Rust links).
fn needed(bin: &Path) -> Vec<String> {
    let out = Command::new("readelf").arg("-d").arg(bin).output().expect("readelf (binutils) must be installed");
    assert!(out.status.success(), "readelf -d {} failed: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // lines like: 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
    text.lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l[l.find('[')? + 1..l.rfind(']')?].to_string()))
        .collect()
}

#[test]
fn harpe_needs_only_glibc_and_libgcc() {
    let bin = Path::new(env!("CARGO_BIN_EXE_harpe"));
    let libs = needed(bin);
    assert!(libs.iter().any(|l| l == "libc.so.6"), "readelf found no NEEDED libc.so.6 in {}: {libs:?}", bin.display());
    let extra: Vec<&String> = libs.iter().filter(|l| !ALLOWED.contains(&l.as_str())).collect();
    assert!(
        extra.is_empty(),
        "{} needs system libraries beyond glibc/libgcc/libstdc++: {extra:?} (all: {libs:?})",
        bin.display()
    );
}

/// The highest GLIBC_x.y symbol version the binary's dynamic symbols ask for is `harpe::floors::GLIBC_FLOOR`:
/// the number `harpe train`'s floor check, scripts/gpu-check.sh and scripts/slurm-harpe-128k.sh state is the
/// one the dynamic loader will demand, so a new dependency that raises it fails here instead of on a cluster.
#[test]
fn the_glibc_floor_is_the_binarys_own() {
    let bin = Path::new(env!("CARGO_BIN_EXE_harpe"));
    let out = Command::new("readelf").args(["--dyn-syms", "-W"]).arg(bin).output().expect("readelf (binutils)");
    assert!(out.status.success(), "readelf --dyn-syms failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let highest = text
        .split("GLIBC_")
        .skip(1)
        .filter_map(|r| {
            let v: String = r.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            harpe::floors::parse_glibc(&v)
        })
        .max()
        .expect("no GLIBC_ symbol versions in the binary");
    assert_eq!(
        highest,
        harpe::floors::GLIBC_FLOOR,
        "{} asks for GLIBC_{}.{}: update floors::GLIBC_FLOOR (and README's floor) to it",
        bin.display(),
        highest.0,
        highest.1
    );
    // the shell checks that run before the binary can (the loader refuses an older glibc silently to harpe)
    let line = format!("GLIBC_FLOOR={}.{}", highest.0, highest.1);
    for script in ["scripts/gpu-check.sh", "scripts/slurm-harpe-128k.sh"] {
        let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(script)).unwrap();
        assert!(text.lines().any(|l| l.trim() == line), "{script} does not set {line}");
    }
}

/// Rows `rows` of a 24-bit BMP as RGB triples (the image crate writes BITMAPINFOHEADER, bottom-up).
fn bmp_pixels(bytes: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    assert_eq!(&bytes[..2], b"BM", "not a BMP file");
    let (off, w, h) = (u32_at(10) as usize, u32_at(18) as usize, i32::from_le_bytes(bytes[22..26].try_into().unwrap()));
    let bpp = u16::from_le_bytes(bytes[28..30].try_into().unwrap()) as usize;
    assert!(bpp == 24 || bpp == 32, "unexpected BMP depth {bpp}");
    let (hh, bottom_up) = (h.unsigned_abs() as usize, h > 0);
    let stride = (w * bpp / 8).div_ceil(4) * 4;
    let mut px = vec![[0u8; 3]; w * hh];
    for y in 0..hh {
        let src = if bottom_up { hh - 1 - y } else { y };
        for x in 0..w {
            let p = off + src * stride + x * bpp / 8;
            px[y * w + x] = [bytes[p + 2], bytes[p + 1], bytes[p]];
        }
    }
    (w, hh, px)
}

/// Dark pixels (any channel < 128) in the title band of harpe's loss plot titled `title`.
fn title_dark_pixels(dir: &Path, title: &str) -> usize {
    let jsonl = dir.join("metrics.jsonl");
    let lines: Vec<String> = (1..=6)
        .map(|s| {
            format!(
                r#"{{"step":{s},"stage":0,"seq_len":64,"loss":{},"grad_norm":1.0,"lr":0.001,"tokens":64,"tokens_seen":{},"tokens_per_s":100.0,"tflops":0.1,"rss_bytes":1,"step_peak_bytes":1,"step_start_bytes":1,"skipped":false,"elapsed_s":0.1}}"#,
                5.0 - 0.5 * s as f64,
                64 * s
            )
        })
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let records = harpe::train::metrics::read_records(&jsonl).unwrap();
    let out = dir.join(format!("loss{}.bmp", title.len()));
    harpe::train::metrics::plot_loss(&records, &out, title).unwrap();
    let (w, _, px) = bmp_pixels(&std::fs::read(&out).unwrap());
    // plot_loss: 900 x 500, margin 12, a 22 px caption centred above the chart: rows 8..34, middle 2/3
    (8..34)
        .flat_map(|y| (w / 6..w * 5 / 6).map(move |x| (x, y)))
        .filter(|&(x, y)| px[y * w + x].iter().any(|&c| c < 128))
        .count()
}

#[test]
fn plot_title_is_drawn_with_the_embedded_font() {
    let d = tempfile::tempdir().unwrap();
    let with_text = title_dark_pixels(d.path(), "harpe loss, embedded DejaVu Sans");
    let without = title_dark_pixels(d.path(), "");
    // the band is background without a title (so the count measures the title's glyphs), and a title of
    // 32 characters at 22 px darkens hundreds of pixels
    assert_eq!(without, 0, "the title band of an untitled plot is not empty: the band is misplaced");
    assert!(with_text > 300, "the title band has only {with_text} dark pixels: the title's text was not drawn");
}
