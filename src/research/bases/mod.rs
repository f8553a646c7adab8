//! HARPE base sets: `search` (waveform, peaks/valleys, the peak–valley search: maths only), `plot`
//! (the waveform figure, reads `search`), `cli` (`harpe search-bases`, uses both). One direction of
//! imports, no cycle; nothing here is model code (applying bases is `model::rope`).
pub mod cli;
pub mod plot;
pub mod search;
