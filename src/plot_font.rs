//! The font every plot draws its text with: DejaVu Sans 2.37 (assets/fonts/DejaVuSans.ttf, Bitstream Vera
//! license beside it), embedded in the binary and rasterized by plotters' pure-Rust `ab_glyph` backend.
//!
//! Reference: plotters' `ab_glyph` feature (`plotters::style::register_font`). The non-obvious decision:
//! no system font lookup at all — plotters' `ttf` feature linked fontconfig and freetype, so a GPU image
//! without them could not even start `harpe` ("error while loading shared libraries"); tests/tools/no_system_libs.rs
//! checks the binary's NEEDED list and that a plot's title has text pixels. The cost is ~760 KB of binary.
//! Does not: offer other families or styles (bold and italic fall back to the regular face).
use anyhow::{anyhow, Result};
use plotters::style::FontStyle;
use std::sync::OnceLock;

/// The family name the plots ask for (`("sans-serif", size)`); the only one registered.
pub const FAMILY: &str = "sans-serif";

static DEJAVU_SANS: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
static REGISTERED: OnceLock<bool> = OnceLock::new();

/// Register the embedded font under [`FAMILY`] (once per process; every drawing function calls this first).
pub fn register() -> Result<()> {
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, DEJAVU_SANS).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded font assets/fonts/DejaVuSans.ttf does not parse\nhint: the file in the source tree is damaged; restore it with `git checkout assets/fonts/DejaVuSans.ttf` and rebuild"))
    }
}
