//! Loss-mask derivation from role / fragment spans, validation, turn-marker parsing.
//!
//! A loss mask has one entry per token: 1 where the token is a training target, 0 elsewhere.
//! Masks arrive in whatever dtype the caller has (`bool`, integers, floats), so they are read
//! through [`MaskView`] and validated without being cast first: a cast would hide a `2` or a
//! `-1` (wrapping or truncating it into a legal value).
use crate::error::{CoreError, CoreResult};

/// A borrowed 1-D loss mask in its original dtype. `U8` also carries `bool` masks, read as
/// bytes: a bool array from numpy or torch can hold a byte other than 0 or 1, which is then
/// reported like any other bad value.
#[derive(Debug, Clone, Copy)]
pub enum MaskView<'a> {
    U8(&'a [u8]),
    I8(&'a [i8]),
    I32(&'a [i32]),
    I64(&'a [i64]),
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// Elements are checked in chunks: a branch-free OR over the chunk (which vectorises), and only
/// a chunk that contains a bad value is scanned again for its first position.
const CHUNK: usize = 4096;

/// Scan of one mask: the first value outside {0, 1} (position and value as text) and whether
/// any value is 1 (undefined once a bad value is found: the scan stops there).
struct Scan {
    first_bad: Option<(usize, String)>,
    any_one: bool,
}

/// A numeric mask element: how a chunk is reduced and how a bad value is recognised.
trait MaskElem: Copy + ToString {
    /// `(any bad value, any 1)` over the chunk, computed without branches.
    fn fold(chunk: &[Self]) -> (bool, bool);
    fn is_bad(self) -> bool;
}

macro_rules! mask_elem_int {
    ($t:ty, $unsigned:ty) => {
        impl MaskElem for $t {
            fn fold(chunk: &[Self]) -> (bool, bool) {
                // Reinterpreted as unsigned, a value is legal iff no bit but the lowest is set,
                // so one OR over the chunk answers both questions (one vector op per element).
                #[allow(clippy::cast_sign_loss)]
                let acc = chunk
                    .iter()
                    .fold(0 as $unsigned, |a, &v| a | (v as $unsigned));
                (acc & !1 != 0, acc & 1 != 0)
            }
            fn is_bad(self) -> bool {
                #[allow(clippy::cast_sign_loss)]
                let u = self as $unsigned;
                u > 1
            }
        }
    };
}
mask_elem_int!(u8, u8);
mask_elem_int!(i8, u8);
mask_elem_int!(i32, u32);
mask_elem_int!(i64, u64);

macro_rules! mask_elem_float {
    ($t:ty) => {
        impl MaskElem for $t {
            fn fold(chunk: &[Self]) -> (bool, bool) {
                chunk.iter().fold((false, false), |(b, o), &v| {
                    (b | ((v != 0.0) & (v != 1.0)), o | (v == 1.0))
                })
            }
            fn is_bad(self) -> bool {
                self != 0.0 && self != 1.0
            }
        }
    };
}
mask_elem_float!(f32);
mask_elem_float!(f64);

/// Scan `s` on the calling thread. A 1M-token int64 mask takes about as long as numpy's own
/// `bitwise_or.reduce` (memory-bound); splitting it over two threads measured slower here.
fn scan<T: MaskElem>(s: &[T]) -> Scan {
    let mut any_one = false;
    let mut offset = 0;
    for chunk in s.chunks(CHUNK) {
        let (bad, ones) = T::fold(chunk);
        any_one |= ones;
        if bad {
            let first_bad = chunk
                .iter()
                .position(|&v| v.is_bad())
                .and_then(|i| chunk.get(i).map(|v| (offset + i, v.to_string())));
            return Scan { first_bad, any_one };
        }
        offset += chunk.len();
    }
    Scan {
        first_bad: None,
        any_one,
    }
}

impl MaskView<'_> {
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::U8(s) => s.len(),
            Self::I8(s) => s.len(),
            Self::I32(s) => s.len(),
            Self::I64(s) => s.len(),
            Self::F32(s) => s.len(),
            Self::F64(s) => s.len(),
        }
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn scan(&self) -> Scan {
        match *self {
            Self::U8(s) => scan(s),
            Self::I8(s) => scan(s),
            Self::I32(s) => scan(s),
            Self::I64(s) => scan(s),
            Self::F32(s) => scan(s),
            Self::F64(s) => scan(s),
        }
    }

    /// Append the mask as booleans. Call only after [`validate`] accepted it.
    fn extend_bools(&self, out: &mut Vec<bool>) {
        match *self {
            Self::U8(s) => out.extend(s.iter().map(|&v| v != 0)),
            Self::I8(s) => out.extend(s.iter().map(|&v| v != 0)),
            Self::I32(s) => out.extend(s.iter().map(|&v| v != 0)),
            Self::I64(s) => out.extend(s.iter().map(|&v| v != 0)),
            Self::F32(s) => out.extend(s.iter().map(|&v| v != 0.0)),
            Self::F64(s) => out.extend(s.iter().map(|&v| v != 0.0)),
        }
    }
}

/// Check a loss mask: its length equals `num_tokens`, every value is 0 or 1, and (when
/// `require_trainable`) at least one value is 1. `sample` names the sample in the error.
///
/// # Errors
/// `MaskLength`, `MaskValue` (with the first bad position) or `MaskNoTrainable`.
pub fn validate(
    mask: MaskView<'_>,
    num_tokens: usize,
    require_trainable: bool,
    sample: &str,
) -> CoreResult<()> {
    if mask.len() != num_tokens {
        return Err(CoreError::MaskLength {
            sample: sample.to_owned(),
            expected: num_tokens,
            actual: mask.len(),
        });
    }
    let scan = mask.scan();
    if let Some((position, value)) = scan.first_bad {
        return Err(CoreError::MaskValue {
            sample: sample.to_owned(),
            position,
            value,
        });
    }
    if require_trainable && !scan.any_one {
        return Err(CoreError::MaskNoTrainable {
            sample: sample.to_owned(),
        });
    }
    Ok(())
}

/// Append a validated mask to `out` as booleans.
///
/// # Errors
/// As [`validate`].
pub fn extend_validated(
    mask: MaskView<'_>,
    num_tokens: usize,
    sample: &str,
    out: &mut Vec<bool>,
) -> CoreResult<()> {
    validate(mask, num_tokens, false, sample)?;
    mask.extend_bools(out);
    Ok(())
}

/// The most tokens one sample may have: Megatron's THD `cu_seqlens` are int32.
pub const MAX_SAMPLE_TOKENS: usize = i32::MAX as usize;

/// Append the mask of consecutive spans to `out`: span `i` has `lengths[i]` tokens, all set to
/// `trainable[i]`. When `num_tokens` is given, the lengths must sum to it.
///
/// # Errors
/// `SpanMismatch` when the two arrays differ in length, a length is negative, or the lengths do
/// not sum to `num_tokens`; `IndexOverflow` when the sum overflows.
pub fn extend_from_spans(
    lengths: &[i64],
    trainable: &[bool],
    num_tokens: Option<usize>,
    sample: &str,
    what: &'static str,
    out: &mut Vec<bool>,
) -> CoreResult<()> {
    if lengths.len() != trainable.len() {
        return Err(CoreError::SpanMismatch {
            sample: sample.to_owned(),
            detail: format!(
                "{} {what} lengths but {} {}",
                lengths.len(),
                trainable.len(),
                if what == "message" {
                    "roles"
                } else {
                    "trainable flags"
                }
            ),
        });
    }
    let mut total: usize = 0;
    for (i, &len) in lengths.iter().enumerate() {
        let n = usize::try_from(len).map_err(|_| CoreError::SpanMismatch {
            sample: sample.to_owned(),
            detail: format!("{what} {i} has negative length {len}"),
        })?;
        total = total.checked_add(n).ok_or(CoreError::IndexOverflow {
            what: "span lengths",
        })?;
    }
    if let Some(expected) = num_tokens {
        if total != expected {
            return Err(CoreError::SpanMismatch {
                sample: sample.to_owned(),
                detail: format!(
                    "{what} lengths sum to {total} but the sample has {expected} tokens"
                ),
            });
        }
    }
    // A sample past `i32::MAX` tokens cannot be addressed by Megatron's int32 `cu_seqlens`, so
    // no mask that long is useful; refusing it also bounds what an unchecked total allocates.
    if total > MAX_SAMPLE_TOKENS {
        return Err(CoreError::SpanMismatch {
            sample: sample.to_owned(),
            detail: format!(
                "{what} lengths sum to {total} tokens, past 2**31 - 1, the most int32 cu_seqlens address"
            ),
        });
    }
    out.try_reserve(total)
        .map_err(|_| CoreError::IndexOverflow {
            what: "span lengths (the mask does not fit in memory)",
        })?;
    for (&len, &flag) in lengths.iter().zip(trainable) {
        // Checked above: every length is non-negative and the sum fits.
        let n = usize::try_from(len).unwrap_or(0);
        out.extend(std::iter::repeat_n(flag, n));
    }
    Ok(())
}

/// Which messages are trained on: `roles[i]` is one of `train_roles` (exact, case-sensitive
/// match).
#[must_use]
pub fn trainable_roles<R: AsRef<str>, T: AsRef<str>>(roles: &[R], train_roles: &[T]) -> Vec<bool> {
    roles
        .iter()
        .map(|r| train_roles.iter().any(|t| t.as_ref() == r.as_ref()))
        .collect()
}

/// Mask from message roles: message `i` has `lengths[i]` tokens and is trained on when its
/// role is in `train_roles`.
///
/// # Errors
/// As [`extend_from_spans`].
pub fn from_roles<R: AsRef<str>, T: AsRef<str>>(
    lengths: &[i64],
    roles: &[R],
    train_roles: &[T],
    num_tokens: Option<usize>,
    sample: &str,
) -> CoreResult<Vec<bool>> {
    let trainable = trainable_roles(roles, train_roles);
    let mut out = Vec::new();
    extend_from_spans(lengths, &trainable, num_tokens, sample, "message", &mut out)?;
    Ok(out)
}

/// Turn spans from marker tokens. Every position whose token is in `markers` starts a turn;
/// turns alternate user, assistant, user, assistant, ... and must come in pairs.
///
/// Returns one row `[user_start, user_end, assistant_start, assistant_end]` per pair, half-open,
/// where `user_start` is the user marker's position, `user_end == assistant_start` is the
/// assistant marker's position, and `assistant_end` is the next user marker's position (or the
/// number of tokens for the last pair). Tokens before the first marker belong to no turn.
///
/// # Errors
/// `TurnMarkers` when there are no markers or an odd number of them (a conversation that ends on
/// a user turn).
pub fn turn_spans(token_ids: &[i64], markers: &[i64], sample: &str) -> CoreResult<Vec<[usize; 4]>> {
    let positions: Vec<usize> = token_ids
        .iter()
        .enumerate()
        .filter(|(_, t)| markers.contains(t))
        .map(|(i, _)| i)
        .collect();
    if positions.is_empty() || positions.len() % 2 != 0 {
        return Err(CoreError::TurnMarkers {
            sample: sample.to_owned(),
            count: positions.len(),
        });
    }
    let n_pairs = positions.len() / 2;
    let mut spans = Vec::with_capacity(n_pairs);
    for (k, pair) in positions.chunks_exact(2).enumerate() {
        let (&[user, assistant], next) = (pair, positions.get(2 * k + 2)) else {
            // chunks_exact(2) always yields two elements.
            continue;
        };
        let end = next.copied().unwrap_or(token_ids.len());
        spans.push([user, assistant, assistant, end]);
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_reports_first_bad_position() {
        let m = [0i64, 1, 1, 2, 5];
        let err = validate(MaskView::I64(&m), 5, false, "s").err();
        assert_eq!(
            err,
            Some(CoreError::MaskValue {
                sample: "s".into(),
                position: 3,
                value: "2".into()
            })
        );
        let neg = [0i8, -1];
        let err = validate(MaskView::I8(&neg), 2, false, "s").err();
        assert!(
            matches!(err, Some(CoreError::MaskValue { position: 1, ref value, .. }) if value == "-1")
        );
        let f = [0.0f32, 0.5];
        assert!(validate(MaskView::F32(&f), 2, false, "s").is_err());
    }

    #[test]
    fn spans_past_int32_tokens_are_refused_before_allocating() {
        let mut out = Vec::new();
        let too_long = i64::from(i32::MAX) + 1;
        for lengths in [
            vec![too_long],
            vec![i64::from(i32::MAX), 1],
            vec![1 << 40, 1 << 40],
        ] {
            let flags = vec![true; lengths.len()];
            let err = extend_from_spans(&lengths, &flags, None, "s", "message", &mut out);
            assert!(
                matches!(err, Err(CoreError::SpanMismatch { .. })),
                "{lengths:?}"
            );
            assert_eq!(out.capacity(), 0);
        }
    }

    #[test]
    fn validate_long_mask_and_trainable() {
        let mut m = vec![0u8; 10_000];
        assert!(validate(MaskView::U8(&m), 10_000, false, "s").is_ok());
        assert!(matches!(
            validate(MaskView::U8(&m), 10_000, true, "s"),
            Err(CoreError::MaskNoTrainable { .. })
        ));
        if let Some(v) = m.get_mut(9000) {
            *v = 3;
        }
        assert!(matches!(
            validate(MaskView::U8(&m), 10_000, false, "s"),
            Err(CoreError::MaskValue { position: 9000, .. })
        ));
        assert!(matches!(
            validate(MaskView::U8(&m), 3, false, "s"),
            Err(CoreError::MaskLength {
                expected: 3,
                actual: 10_000,
                ..
            })
        ));
    }

    #[test]
    fn validate_finds_bad_value_past_first_chunk_in_every_dtype() {
        let n = 3 * CHUNK + 5;
        let at = 2 * CHUNK + 7;
        let mut i = vec![0i64; n];
        let mut f = vec![1.0f64; n];
        let mut s = vec![1i8; n];
        if let (Some(a), Some(b), Some(c)) = (i.get_mut(at), f.get_mut(at), s.get_mut(at)) {
            *a = i64::MIN;
            *b = -0.5;
            *c = -128;
        }
        for (view, value) in [
            (MaskView::I64(&i), i64::MIN.to_string()),
            (MaskView::F64(&f), "-0.5".to_owned()),
            (MaskView::I8(&s), "-128".to_owned()),
        ] {
            assert_eq!(
                validate(view, n, true, "s").err(),
                Some(CoreError::MaskValue {
                    sample: "s".into(),
                    position: at,
                    value
                })
            );
        }
        let ones_late = {
            let mut v = vec![0i32; n];
            if let Some(x) = v.last_mut() {
                *x = 1;
            }
            v
        };
        assert!(validate(MaskView::I32(&ones_late), n, true, "s").is_ok());
    }

    #[test]
    fn roles_and_spans() {
        let m = from_roles(
            &[2, 1, 3],
            &["user", "assistant", "user"],
            &["assistant"],
            Some(6),
            "s",
        );
        assert_eq!(m.ok(), Some(vec![false, false, true, false, false, false]));
        assert!(from_roles(&[2, 1], &["user"], &["assistant"], None, "s").is_err());
        assert!(from_roles(&[2, -1], &["user", "a"], &["assistant"], None, "s").is_err());
        assert!(from_roles(&[2, 1], &["user", "a"], &["assistant"], Some(4), "s").is_err());
    }

    #[test]
    fn turns() {
        let toks = [9, 1, 5, 2, 6, 6, 1, 7, 2, 8];
        let spans = turn_spans(&toks, &[1, 2], "s").ok();
        assert_eq!(spans, Some(vec![[1, 3, 3, 6], [6, 8, 8, 10]]));
        assert!(matches!(
            turn_spans(&toks[..8], &[1, 2], "s"),
            Err(CoreError::TurnMarkers { count: 3, .. })
        ));
        assert!(turn_spans(&[5, 6], &[1, 2], "s").is_err());
    }
}
