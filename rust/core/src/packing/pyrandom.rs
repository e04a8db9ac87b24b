//! CPython's `random.shuffle` on `list(range(n))`, reproduced bit for bit from a Mersenne
//! Twister state (`random.getstate()`), so `first_fit_shuffle` matches NeMo-RL's order for
//! the same seed without a Python loop. CPython: `shuffle` walks `i = n-1 .. 1` and swaps
//! `x[i]` with `x[_randbelow(i + 1)]`; `_randbelow(m)` draws `getrandbits(m.bit_length())`
//! until the value is below `m`; `getrandbits(k <= 32)` is `genrand_uint32() >> (32 - k)`.

use crate::error::{CoreError, CoreResult};

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER: u32 = 0x8000_0000;
const LOWER: u32 = 0x7fff_ffff;

struct Mt<'a> {
    mt: &'a mut [u32],
    pos: usize,
}

impl Mt<'_> {
    fn twist(&mut self) {
        let mt = &mut *self.mt;
        let mag = |y: u32| if y & 1 == 0 { 0 } else { MATRIX_A };
        for kk in 0..N - M {
            let y = (mt[kk] & UPPER) | (mt[kk + 1] & LOWER);
            mt[kk] = mt[kk + M] ^ (y >> 1) ^ mag(y);
        }
        for kk in N - M..N - 1 {
            let y = (mt[kk] & UPPER) | (mt[kk + 1] & LOWER);
            mt[kk] = mt[kk + M - N] ^ (y >> 1) ^ mag(y);
        }
        let y = (mt[N - 1] & UPPER) | (mt[0] & LOWER);
        mt[N - 1] = mt[M - 1] ^ (y >> 1) ^ mag(y);
        self.pos = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.pos >= N {
            self.twist();
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    fn below(&mut self, m: u32) -> u32 {
        let k = 32 - m.leading_zeros();
        loop {
            let r = self.next_u32() >> (32 - k);
            if r < m {
                return r;
            }
        }
    }
}

/// Shuffles `0..n` as `random.shuffle(list(range(n)))` would from the Mersenne Twister
/// state `state` (624 words) at position `pos`; advances the state in place and returns the
/// permutation and the new position.
///
/// # Errors
/// `PackingArgument` for a malformed state or `n` above `u32::MAX`.
pub fn shuffle_permutation(
    state: &mut [u32],
    pos: usize,
    n: usize,
) -> CoreResult<(Vec<i64>, usize)> {
    if state.len() != N || pos > N {
        return Err(CoreError::PackingArgument {
            name: "random_state",
            detail: format!(
                "expected {N} state words and a position <= {N}, got {} words and position {pos}",
                state.len()
            ),
        });
    }
    if u32::try_from(n).is_err() {
        return Err(CoreError::PackingArgument {
            name: "lengths",
            detail: format!("shuffle supports at most {} items, got {n}", u32::MAX),
        });
    }
    // up to u32::MAX items is 32 GiB: a refusal is an error, not an abort
    let mut x: Vec<i64> = crate::alloc::vec_with_capacity(n, || CoreError::PackingArgument {
        name: "n",
        detail: format!("the permutation of {n} items cannot be allocated"),
    })?;
    x.extend(0..n as i64);
    let mut rng = Mt { mt: state, pos };
    for i in (1..n).rev() {
        let j = rng.below((i + 1) as u32) as usize;
        x.swap(i, j);
    }
    Ok((x, rng.pos))
}
