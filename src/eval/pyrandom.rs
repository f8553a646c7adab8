//! A port of CPython's `random.Random` (MT19937) for the calls RULER's NIAH generator makes.
//!
//! Reference: CPython 3.11 `Modules/_randommodule.c` (`init_by_array`, `genrand_uint32`,
//! `random_random`, `getrandbits`) and `Lib/random.py` (`_randbelow_with_getrandbits`, `randint`,
//! `choice`, `shuffle`, `sample`); tests/stage_eval/niah_pyrandom.rs checks it against CPython's outputs.
//!
//! The non-obvious decision: every method consumes the generator exactly as CPython does (one
//! 32-bit draw for `getrandbits(1)`, rejection sampling in `_randbelow`, `sample`'s switch between
//! the pool and the set method), because bit-exact RULER samples depend on the draw count.
//! Not ported: seeding from str/bytes/None, `getstate`, floats other than `random()`, `gauss` etc.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// CPython-compatible Mersenne Twister generator (`random.Random`).
#[derive(Clone)]
pub struct PyRandom {
    mt: [u32; N],
    mti: usize,
}

impl PyRandom {
    /// `random.Random(seed)` / `random.seed(seed)` for an integer seed (CPython uses `|seed|`).
    pub fn new(seed: i64) -> Self {
        let mut a = seed.unsigned_abs();
        let mut key = Vec::new();
        // |seed| as little-endian 32-bit words; 0 -> [0].
        loop {
            key.push(a as u32);
            a >>= 32;
            if a == 0 {
                break;
            }
        }
        let mut r = PyRandom { mt: [0; N], mti: N + 1 };
        r.init_by_array(&key);
        r
    }

    fn init_genrand(&mut self, s: u32) {
        self.mt[0] = s;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(i as u32);
        }
        self.mti = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        let mut k = N.max(key.len());
        while k > 0 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
            k -= 1;
        }
        k = N - 1;
        while k > 0 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            k -= 1;
        }
        self.mt[0] = 0x8000_0000;
    }

    /// One raw 32-bit output of MT19937 (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.mti >= N {
            for kk in 0..N {
                let y = (self.mt[kk] & UPPER_MASK) | (self.mt[(kk + 1) % N] & LOWER_MASK);
                let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
                self.mt[kk] = self.mt[(kk + M) % N] ^ (y >> 1) ^ mag;
            }
            self.mti = 0;
        }
        let mut y = self.mt[self.mti];
        self.mti += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// `random()`: a float in [0, 1) with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for 1 <= k <= 128: words are filled from least to most significant.
    pub fn getrandbits(&mut self, k: u32) -> u128 {
        assert!((1..=128).contains(&k), "getrandbits supports 1..=128 bits, got {k}");
        if k <= 32 {
            return (self.next_u32() >> (32 - k)) as u128;
        }
        let mut out = 0u128;
        let mut remaining = k;
        let mut shift = 0;
        while remaining > 0 {
            let mut w = self.next_u32();
            if remaining < 32 {
                w >>= 32 - remaining;
            }
            out |= (w as u128) << shift;
            shift += 32;
            remaining = remaining.saturating_sub(32);
        }
        out
    }

    /// `_randbelow(n)`: uniform in [0, n) by rejection on `bit_length(n)` random bits; n >= 1.
    pub fn randbelow(&mut self, n: u64) -> u64 {
        assert!(n >= 1, "randbelow needs n >= 1");
        let k = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k) as u64;
            if r < n {
                return r;
            }
        }
    }

    /// `randint(a, b)`: uniform in [a, b], both inclusive.
    pub fn randint(&mut self, a: i64, b: i64) -> i64 {
        assert!(b >= a, "randint needs a <= b");
        a + self.randbelow((b - a + 1) as u64) as i64
    }

    /// `choice(seq)`: one element, uniformly; the index is returned so callers can index lazily.
    pub fn choice_index(&mut self, len: usize) -> usize {
        self.randbelow(len as u64) as usize
    }

    /// `shuffle(x)` in place (Fisher-Yates from the end, as CPython).
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            x.swap(i, j);
        }
    }

    /// `sample(range(n), k)`: k distinct indices in CPython's order (pool or set method).
    pub fn sample_indices(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample larger than population");
        let mut setsize = 21usize;
        if k > 5 {
            let e = ((k as f64 * 3.0).ln() / 4f64.ln()).ceil() as u32;
            setsize += 4usize.pow(e);
        }
        let mut result = Vec::with_capacity(k);
        if n <= setsize {
            let mut pool: Vec<usize> = (0..n).collect();
            for i in 0..k {
                let j = self.randbelow((n - i) as u64) as usize;
                result.push(pool[j]);
                pool[j] = pool[n - i - 1];
            }
        } else {
            let mut selected = std::collections::HashSet::with_capacity(k);
            for _ in 0..k {
                let mut j = self.randbelow(n as u64) as usize;
                while selected.contains(&j) {
                    j = self.randbelow(n as u64) as usize;
                }
                selected.insert(j);
                result.push(j);
            }
        }
        result
    }

    /// `sample(pop, k)` over a slice.
    pub fn sample<T: Clone>(&mut self, pop: &[T], k: usize) -> Vec<T> {
        self.sample_indices(pop.len(), k).into_iter().map(|i| pop[i].clone()).collect()
    }

    /// `str(uuid.UUID(int=getrandbits(128), version=4))`, as RULER makes its uuid needles.
    pub fn uuid4(&mut self) -> String {
        let mut v = self.getrandbits(128);
        v &= !(0xc000u128 << 48);
        v |= 0x8000u128 << 48;
        v &= !(0xf000u128 << 64);
        v |= 4u128 << 76;
        let h = format!("{v:032x}");
        format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
    }
}
