//! Packed sequence layout: cu_seqlens, padded cu_seqlens, position ids, flat gathers of token /
//! label / mask arrays.
//!
//! Layout (Megatron THD): sample `i` occupies
//! `[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)` of the flat arrays, followed by
//! `padded_len_i - len_i` padding positions. `padded_len_i` rounds `len_i` up to
//! `pad_to_multiple_of`, and (when `cp_size > 1`) to the least common multiple of that and
//! `2 * cp_size`.
//!
//! Labels are next-token targets gated by the mask at the *target* position:
//! `labels[p] = input_ids[p + 1]` when `p + 1` is inside the same sample and
//! `loss_mask[p + 1] == 1`, else `ignore_index`. So the last token of every sample and every
//! padding position get `ignore_index`, and a mask of `[0, 0, 1]` trains exactly one
//! prediction: the third token, predicted at position 1.
use crate::error::{CoreError, CoreResult};
use crate::mask::{self, MaskView};

/// Who provides the loss mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskMode {
    /// Derived from message lengths and roles.
    Derived,
    /// The sample's own mask, validated.
    Precomputed,
}

/// One encoded sample, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct SampleRef<'a> {
    /// How errors name the sample.
    pub name: &'a str,
    pub tokens: &'a [i64],
    pub mask: Option<MaskView<'a>>,
    pub message_lengths: Option<&'a [i64]>,
    pub message_roles: Option<&'a [String]>,
}

#[derive(Debug, Clone)]
pub struct BatchOptions<'a> {
    pub mode: MaskMode,
    pub train_roles: &'a [String],
    pub pad_token_id: i64,
    pub pad_to_multiple_of: i64,
    pub ignore_index: i64,
    pub cp_size: i64,
}

/// The flat arrays of one pack in Megatron's THD layout (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThdLayout {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub loss_mask: Vec<bool>,
    pub position_ids: Vec<i64>,
    pub cu_seqlens: Vec<i32>,
    pub cu_seqlens_padded: Vec<i32>,
    pub max_seqlen: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    let (mut a, mut b) = (a, b);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The multiple every sample is padded to.
///
/// # Errors
/// `BatchOption` for `pad_to_multiple_of < 1` or `cp_size < 1`; `IndexOverflow`.
pub fn pad_multiple(pad_to_multiple_of: i64, cp_size: i64) -> CoreResult<usize> {
    let pad = usize::try_from(pad_to_multiple_of)
        .ok()
        .filter(|&p| p >= 1)
        .ok_or_else(|| CoreError::BatchOption {
            name: "pad_to_multiple_of",
            detail: format!("must be >= 1, got {pad_to_multiple_of}"),
        })?;
    let cp = usize::try_from(cp_size)
        .ok()
        .filter(|&c| c >= 1)
        .ok_or_else(|| CoreError::BatchOption {
            name: "cp_size",
            detail: format!("must be >= 1, got {cp_size}"),
        })?;
    if cp == 1 {
        return Ok(pad);
    }
    let two_cp = cp.checked_mul(2).ok_or(CoreError::IndexOverflow {
        what: "2 * cp_size",
    })?;
    (pad / gcd(pad, two_cp))
        .checked_mul(two_cp)
        .ok_or(CoreError::IndexOverflow {
            what: "the padding multiple",
        })
}

fn round_up(n: usize, multiple: usize) -> CoreResult<usize> {
    let over = CoreError::IndexOverflow {
        what: "padded sequence length",
    };
    let rem = n % multiple;
    if rem == 0 {
        Ok(n)
    } else {
        n.checked_add(multiple - rem).ok_or(over)
    }
}

fn as_i32(v: usize) -> CoreResult<i32> {
    i32::try_from(v).map_err(|_| CoreError::IndexOverflow {
        what: "cu_seqlens (int32)",
    })
}

/// Append sample `s`'s loss mask (one bool per token) to `out`.
fn extend_mask(
    s: &SampleRef<'_>,
    opts: &BatchOptions<'_>,
    trainable: &mut Vec<bool>,
    out: &mut Vec<bool>,
) -> CoreResult<()> {
    let n = s.tokens.len();
    match opts.mode {
        MaskMode::Precomputed => {
            let m = s.mask.ok_or_else(|| CoreError::MissingField {
                sample: s.name.to_owned(),
                field: "loss_mask",
                mode: "'precomputed'",
            })?;
            mask::extend_validated(m, n, s.name, out)
        }
        MaskMode::Derived => {
            let missing = |field| CoreError::MissingField {
                sample: s.name.to_owned(),
                field,
                mode: "None (derived from roles)",
            };
            let lengths = s
                .message_lengths
                .ok_or_else(|| missing("message_lengths"))?;
            let roles = s.message_roles.ok_or_else(|| missing("message_roles"))?;
            trainable.clear();
            trainable.extend(
                roles
                    .iter()
                    .map(|r| opts.train_roles.iter().any(|t| t == r)),
            );
            mask::extend_from_spans(lengths, trainable, Some(n), s.name, "message", out)
        }
    }
}

/// Build one pack from `samples` (see the module docs for the layout and label convention).
///
/// # Errors
/// `EmptyBatch`, `EmptySample`, `InvalidToken`, `MissingField`, mask errors (`MaskLength`,
/// `MaskValue`, `SpanMismatch`), `BatchOption`, `IndexOverflow` (a pack past `i32::MAX` tokens).
pub fn build(samples: &[SampleRef<'_>], opts: &BatchOptions<'_>) -> CoreResult<ThdLayout> {
    if samples.is_empty() {
        return Err(CoreError::EmptyBatch);
    }
    let multiple = pad_multiple(opts.pad_to_multiple_of, opts.cp_size)?;

    // Pass 1: layout (offsets and sizes).
    let mut cu = Vec::with_capacity(samples.len() + 1);
    let mut cu_padded = Vec::with_capacity(samples.len() + 1);
    cu.push(0i32);
    cu_padded.push(0i32);
    let (mut total, mut total_padded, mut max_seqlen) = (0usize, 0usize, 0usize);
    for s in samples {
        let n = s.tokens.len();
        let padded = round_up(n, multiple)?;
        max_seqlen = max_seqlen.max(padded);
        total = total.checked_add(n).ok_or(CoreError::IndexOverflow {
            what: "pack length",
        })?;
        total_padded = total_padded
            .checked_add(padded)
            .ok_or(CoreError::IndexOverflow {
                what: "padded pack length",
            })?;
        cu.push(as_i32(total)?);
        cu_padded.push(as_i32(total_padded)?);
    }

    // Pass 2, sample by sample: checks (tokens, then mask), then the flat arrays.
    let mut sample_mask: Vec<bool> = Vec::with_capacity(max_seqlen);
    let mut trainable: Vec<bool> = Vec::new();
    let mut input_ids = Vec::with_capacity(total_padded);
    let mut labels = Vec::with_capacity(total_padded);
    let mut loss_mask = Vec::with_capacity(total_padded);
    let mut position_ids = Vec::with_capacity(total_padded);
    for s in samples {
        let n = s.tokens.len();
        if n == 0 {
            return Err(CoreError::EmptySample {
                sample: s.name.to_owned(),
            });
        }
        if let Some(pos) = s.tokens.iter().position(|&t| t < 0) {
            let value = s.tokens.get(pos).copied().unwrap_or(-1);
            return Err(CoreError::InvalidToken {
                sample: s.name.to_owned(),
                position: pos,
                value,
            });
        }
        let padded = round_up(n, multiple)?;
        let pad = padded - n;
        sample_mask.clear();
        extend_mask(s, opts, &mut trainable, &mut sample_mask)?;

        input_ids.extend_from_slice(s.tokens);
        input_ids.extend(std::iter::repeat_n(opts.pad_token_id, pad));
        // labels[p] = tokens[p + 1] gated by mask[p + 1]; the last token has no target.
        labels.extend(s.tokens.iter().zip(&sample_mask).skip(1).map(|(&t, &m)| {
            if m {
                t
            } else {
                opts.ignore_index
            }
        }));
        labels.extend(std::iter::repeat_n(opts.ignore_index, pad + 1));
        loss_mask.extend_from_slice(&sample_mask);
        loss_mask.extend(std::iter::repeat_n(false, pad));
        let p_end = i64::try_from(padded).map_err(|_| CoreError::IndexOverflow {
            what: "position ids",
        })?;
        position_ids.extend(0..p_end);
    }
    Ok(ThdLayout {
        input_ids,
        labels,
        loss_mask,
        position_ids,
        cu_seqlens: cu,
        cu_seqlens_padded: cu_padded,
        max_seqlen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mode: MaskMode, roles: &[String], pad: i64, cp: i64) -> BatchOptions<'_> {
        BatchOptions {
            mode,
            train_roles: roles,
            pad_token_id: 0,
            pad_to_multiple_of: pad,
            ignore_index: -100,
            cp_size: cp,
        }
    }

    #[test]
    fn worked_example_both_modes() {
        let tokens = [11i64, 12, 13, 14, 21, 22, 23];
        let mask = [0u8, 0, 0, 0, 1, 1, 1];
        let roles = vec!["user".to_owned(), "assistant".to_owned()];
        let train = vec!["assistant".to_owned()];
        let pre = SampleRef {
            name: "'s0'",
            tokens: &tokens,
            mask: Some(MaskView::U8(&mask)),
            message_lengths: None,
            message_roles: None,
        };
        let der = SampleRef {
            name: "'s0'",
            tokens: &tokens,
            mask: None,
            message_lengths: Some(&[4, 3]),
            message_roles: Some(&roles),
        };
        let a = build(&[pre], &opts(MaskMode::Precomputed, &train, 1, 1));
        let b = build(&[der], &opts(MaskMode::Derived, &train, 1, 1));
        assert!(a.is_ok());
        assert_eq!(a, b);
        if let Ok(a) = a {
            assert_eq!(
                a.loss_mask,
                vec![false, false, false, false, true, true, true]
            );
            assert_eq!(a.labels, vec![-100, -100, -100, 21, 22, 23, -100]);
            assert_eq!(a.cu_seqlens, vec![0, 7]);
        }
    }

    #[test]
    fn padding_and_cp() {
        assert_eq!(pad_multiple(1, 2).ok(), Some(4));
        assert_eq!(pad_multiple(6, 2).ok(), Some(12));
        assert_eq!(pad_multiple(8, 2).ok(), Some(8));
        assert!(pad_multiple(0, 1).is_err());
        assert!(pad_multiple(1, 0).is_err());
        let t1 = [1i64, 2, 3];
        let t2 = [4i64, 5, 6, 7, 8];
        let m1 = [1u8, 1, 1];
        let m2 = [1i64, 1, 1, 1, 1];
        let s = [
            SampleRef {
                name: "a",
                tokens: &t1,
                mask: Some(MaskView::U8(&m1)),
                message_lengths: None,
                message_roles: None,
            },
            SampleRef {
                name: "b",
                tokens: &t2,
                mask: Some(MaskView::I64(&m2)),
                message_lengths: None,
                message_roles: None,
            },
        ];
        let out = build(&s, &opts(MaskMode::Precomputed, &[], 4, 1));
        assert!(out.is_ok());
        if let Ok(out) = out {
            assert_eq!(out.cu_seqlens, vec![0, 3, 8]);
            assert_eq!(out.cu_seqlens_padded, vec![0, 4, 12]);
            assert_eq!(out.input_ids, vec![1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]);
            assert_eq!(out.position_ids, vec![0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]);
            assert_eq!(
                out.labels,
                vec![2, 3, -100, -100, 5, 6, 7, 8, -100, -100, -100, -100]
            );
            assert_eq!(out.max_seqlen, 8);
        }
    }

    #[test]
    fn errors_name_the_sample() {
        let t = [1i64, 2];
        let base = SampleRef {
            name: "x",
            tokens: &t,
            mask: None,
            message_lengths: None,
            message_roles: None,
        };
        let o = opts(MaskMode::Precomputed, &[], 1, 1);
        assert!(matches!(
            build(&[base], &o),
            Err(CoreError::MissingField { .. })
        ));
        assert!(matches!(build(&[], &o), Err(CoreError::EmptyBatch)));
        let e = SampleRef {
            tokens: &[],
            ..base
        };
        assert!(matches!(
            build(&[e], &o),
            Err(CoreError::EmptySample { .. })
        ));
        let neg = SampleRef {
            tokens: &[1, -5],
            mask: Some(MaskView::U8(&[0, 1])),
            ..base
        };
        assert!(matches!(
            build(&[neg], &o),
            Err(CoreError::InvalidToken {
                position: 1,
                value: -5,
                ..
            })
        ));
        let d = opts(MaskMode::Derived, &[], 1, 1);
        assert!(matches!(
            build(&[base], &d),
            Err(CoreError::MissingField {
                field: "message_lengths",
                ..
            })
        ));
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Layout invariants for random precomputed-mask samples and options.
        #[test]
        fn layout_invariants(
            lens in proptest::collection::vec(1usize..40, 1..8),
            pad in 1i64..9,
            cp in 1i64..4,
            seed in any::<u64>(),
        ) {
            let tokens: Vec<Vec<i64>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| i64::try_from(i * 100 + j).unwrap_or(0)).collect())
                .collect();
            let masks: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| u8::from((seed >> ((i + j) % 64)) & 1 == 1)).collect())
                .collect();
            let samples: Vec<SampleRef<'_>> = tokens
                .iter()
                .zip(&masks)
                .map(|(t, m)| SampleRef {
                    name: "p",
                    tokens: t,
                    mask: Some(MaskView::U8(m)),
                    message_lengths: None,
                    message_roles: None,
                })
                .collect();
            let opts = BatchOptions {
                mode: MaskMode::Precomputed,
                train_roles: &[],
                pad_token_id: 0,
                pad_to_multiple_of: pad,
                ignore_index: -100,
                cp_size: cp,
            };
            let out = build(&samples, &opts);
            prop_assert!(out.is_ok());
            let Ok(out) = out else { return Ok(()) };
            let multiple = pad_multiple(pad, cp).unwrap_or(1);
            let total = usize::try_from(*out.cu_seqlens_padded.last().unwrap_or(&0)).unwrap_or(0);
            prop_assert_eq!(out.input_ids.len(), total);
            prop_assert_eq!(out.labels.len(), total);
            prop_assert_eq!(out.loss_mask.len(), total);
            prop_assert_eq!(out.position_ids.len(), total);
            for (i, w) in out.cu_seqlens_padded.windows(2).enumerate() {
                let (Some(&a), Some(&b)) = (w.first(), w.get(1)) else { continue };
                let width = usize::try_from(b - a).unwrap_or(0);
                prop_assert_eq!(width % multiple, 0);
                prop_assert!(width >= lens.get(i).copied().unwrap_or(0));
                // labels: next token where the target's mask is 1
                let start = usize::try_from(a).unwrap_or(0);
                let n = lens.get(i).copied().unwrap_or(0);
                for p in 0..width {
                    let got = out.labels.get(start + p).copied();
                    let target = masks.get(i).and_then(|m| m.get(p + 1)).copied();
                    let want = if p + 1 < n && target == Some(1) {
                        tokens.get(i).and_then(|t| t.get(p + 1)).copied()
                    } else {
                        Some(-100)
                    };
                    prop_assert_eq!(got, want);
                }
            }
        }

        /// The chunked scan finds the same first bad value as a plain loop.
        #[test]
        fn validate_matches_naive(values in proptest::collection::vec(-2i64..3, 0..10_000)) {
            let naive = values.iter().position(|&v| v != 0 && v != 1);
            let got = mask::validate(MaskView::I64(&values), values.len(), false, "p");
            match naive {
                None => prop_assert!(got.is_ok()),
                Some(p) => {
                    let hit = matches!(got, Err(CoreError::MaskValue { position, .. }) if position == p);
                    prop_assert!(hit);
                }
            }
        }
    }
}
