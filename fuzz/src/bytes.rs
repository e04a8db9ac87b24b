//! A tiny deterministic decoder from fuzzer bytes: every read succeeds (zeros once the input
//! is exhausted), so any byte string is a valid input and the regression tests can replay
//! inputs as plain byte strings without the `arbitrary` crate.

/// Special integers that tend to break index arithmetic.
const SPECIAL: [i64; 16] = [
    i64::MIN,
    i64::MIN + 1,
    -1,
    0,
    1,
    i64::MAX,
    i64::MAX - 1,
    i32::MAX as i64,
    i32::MAX as i64 + 1,
    u32::MAX as i64,
    u32::MAX as i64 + 1,
    1 << 40,
    1 << 62,
    -(1 << 31),
    i64::MAX / 2 + 1,
    4096,
];

pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    #[must_use]
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    pub fn flag(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A value in `0..n` (0 when `n == 0`); one byte when `n <= 256`, two otherwise.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        if n <= 256 {
            usize::from(self.u8()) % n
        } else {
            usize::from(self.u16()) % n
        }
    }

    /// A value in `lo..=hi` (`hi - lo < 65536`).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = usize::try_from(hi.saturating_sub(lo).saturating_add(1)).unwrap_or(1);
        lo.saturating_add(i64::try_from(self.below(span)).unwrap_or(0))
    }

    /// Mostly a value in `lo..=hi`, sometimes one of [`SPECIAL`].
    pub fn wild(&mut self, lo: i64, hi: i64) -> i64 {
        let tag = self.u8();
        if tag >= 240 {
            SPECIAL[usize::from(tag - 240)]
        } else {
            self.range(lo, hi)
        }
    }
}
