//! The batch builder against a direct model of the THD layout (see `mmpack_core::batch`):
//! identical arrays when the model accepts the samples, an error when it refuses them.
use mmpack_core::batch::{
    build, check_thd, pad_multiple, BatchOptions, MaskMode, SampleRef, ThdLayout, ThdView,
};
use mmpack_core::mask::MaskView;

use crate::bytes::Bytes;

struct Sample {
    name: String,
    tokens: Vec<i64>,
    mask: Option<Vec<i64>>,
    mask_u8: bool,
    lengths: Option<Vec<i64>>,
    roles: Option<Vec<String>>,
}

const ROLES: [&str; 3] = ["user", "assistant", "system"];

fn gen_sample(b: &mut Bytes<'_>, k: usize) -> Sample {
    let n = b.below(12);
    let tokens: Vec<i64> = (0..n)
        .map(|_| if b.u8() < 8 { -1 } else { b.range(0, 50) })
        .collect();
    let shape = b.u8();
    let mask = (shape & 1 == 1).then(|| {
        let len = if shape & 2 == 0 { n } else { b.below(13) };
        (0..len)
            .map(|_| match b.u8() {
                0..=120 => 0,
                121..=250 => 1,
                _ => 2,
            })
            .collect()
    });
    let lengths = (shape & 4 == 4).then(|| {
        let parts = b.below(4) + 1;
        let mut left = n as i64;
        let mut v = Vec::with_capacity(parts);
        for p in 0..parts {
            let l = if p + 1 == parts {
                left
            } else {
                b.range(0, left.max(0))
            };
            left -= l;
            v.push(l);
        }
        if shape & 8 == 8 && !v.is_empty() {
            let at = b.below(v.len());
            v[at] = b.wild(-1, 5);
        }
        v
    });
    let roles = (shape & 16 == 16).then(|| {
        let len = lengths.as_ref().map_or(0, Vec::len) + usize::from(shape & 32 == 32);
        (0..len).map(|_| ROLES[b.below(3)].to_owned()).collect()
    });
    Sample {
        name: format!("'s{k}'"),
        tokens,
        mask,
        mask_u8: shape & 64 == 64,
        lengths,
        roles,
    }
}

/// The layout, or `None` when the samples or options must be refused.
fn model(samples: &[Sample], opts: &BatchOptions, u8_masks: &[Vec<u8>]) -> Option<ThdLayout> {
    if samples.is_empty()
        || opts.pad_to_multiple_of < 1
        || opts.cp_size < 1
        || opts.pad_token_id < 0
    {
        return None;
    }
    let pad = i128::from(opts.pad_to_multiple_of);
    let cp = i128::from(opts.cp_size);
    let multiple = if cp == 1 {
        pad
    } else {
        let two = 2 * cp;
        let (mut a, mut g) = (pad, two);
        while g != 0 {
            (a, g) = (g, a % g);
        }
        pad / a * two
    };
    let mut out = ThdLayout {
        input_ids: Vec::new(),
        labels: Vec::new(),
        loss_mask: Vec::new(),
        token_mask: Vec::new(),
        position_ids: Vec::new(),
        cu_seqlens: vec![0],
        cu_seqlens_padded: vec![0],
        max_seqlen: 0,
    };
    // Every sample has a token (or is refused), so a multiple past int32 never fits.
    if multiple > i128::from(i32::MAX) {
        return None;
    }
    // Like the builder, the whole layout must fit in int32 before any array is built.
    let all_padded: i128 = samples
        .iter()
        .map(|s| (s.tokens.len() as i128 + multiple - 1) / multiple * multiple)
        .sum();
    if all_padded > i128::from(i32::MAX) {
        return None;
    }
    // pad_to_length: positive, a multiple of the multiple, at least the pack; the last sample
    // absorbs the difference.
    let tail = match opts.pad_to_length {
        None => 0,
        Some(l) => {
            let l = i128::from(l);
            if l < 1 || l % multiple != 0 || l < all_padded || l > i128::from(i32::MAX) {
                return None;
            }
            l - all_padded
        }
    };
    let (mut total, mut total_padded) = (0i128, 0i128);
    for (k, s) in samples.iter().enumerate() {
        let n = s.tokens.len() as i128;
        let mut padded = (n + multiple - 1) / multiple * multiple;
        if k + 1 == samples.len() {
            padded += tail;
        }
        total += n;
        total_padded += padded;
        if total_padded > i128::from(i32::MAX) {
            return None;
        }
        out.cu_seqlens.push(total as i32);
        out.cu_seqlens_padded.push(total_padded as i32);
        out.max_seqlen = out.max_seqlen.max(padded as usize);
        if n == 0 || s.tokens.iter().any(|&t| t < 0) {
            return None;
        }
        let mask: Vec<bool> = match opts.mode {
            MaskMode::Precomputed => {
                let m = if s.mask_u8 {
                    u8_masks[k].iter().map(|&x| i64::from(x)).collect()
                } else {
                    s.mask.clone()?
                };
                if m.len() as i128 != n || m.iter().any(|&x| x != 0 && x != 1) {
                    return None;
                }
                m.iter().map(|&x| x == 1).collect()
            }
            MaskMode::Derived => {
                let (l, r) = (s.lengths.as_ref()?, s.roles.as_ref()?);
                if l.len() != r.len() || l.iter().any(|&x| x < 0) {
                    return None;
                }
                if l.iter().map(|&x| i128::from(x)).sum::<i128>() != n {
                    return None;
                }
                let mut m = Vec::new();
                for (&len, role) in l.iter().zip(r) {
                    let t = opts.train_roles.contains(role);
                    m.extend(std::iter::repeat_n(t, len as usize));
                }
                m
            }
        };
        let pad_n = (padded - n) as usize;
        out.input_ids.extend(&s.tokens);
        out.input_ids
            .extend(std::iter::repeat_n(opts.pad_token_id, pad_n));
        for p in 0..s.tokens.len() {
            let trained = p + 1 < s.tokens.len() && mask[p + 1];
            out.labels.push(if trained {
                s.tokens[p + 1]
            } else {
                opts.ignore_index
            });
            out.loss_mask.push(trained);
        }
        out.labels
            .extend(std::iter::repeat_n(opts.ignore_index, pad_n));
        out.loss_mask.extend(std::iter::repeat_n(false, pad_n));
        out.token_mask.extend(&mask);
        out.token_mask.extend(std::iter::repeat_n(false, pad_n));
        out.position_ids.extend(0..padded as i64);
    }
    // ignore_index must not be a token id of the batch.
    let top = samples.iter().flat_map(|s| s.tokens.iter().copied()).max();
    if top.is_some_and(|t| (0..=t).contains(&opts.ignore_index)) {
        return None;
    }
    Some(out)
}

/// The batch-builder fuzz check.
pub fn check(data: &[u8]) {
    let mut b = Bytes::new(data);
    let n = b.below(5);
    let samples: Vec<Sample> = (0..n).map(|k| gen_sample(&mut b, k)).collect();
    let u8_masks: Vec<Vec<u8>> = samples
        .iter()
        .map(|s| s.mask.iter().flatten().map(|&x| x as u8).collect())
        .collect();
    let train_roles: Vec<String> = (0..b.below(3))
        .map(|_| ROLES[b.below(3)].to_owned())
        .collect();
    let big_pad = b.u8() == 255;
    let opts = BatchOptions {
        mode: if b.flag() {
            MaskMode::Derived
        } else {
            MaskMode::Precomputed
        },
        train_roles,
        pad_token_id: b.wild(-3, 3),
        pad_to_multiple_of: if big_pad {
            b.wild(1 << 12, 1 << 12)
        } else {
            b.wild(-1, 9)
        },
        ignore_index: if b.u8() < 16 {
            b.wild(0, 60)
        } else {
            b.wild(-101, -99)
        },
        cp_size: if b.u8() == 255 {
            b.wild(1 << 20, 1 << 20)
        } else {
            b.wild(-1, 4)
        },
        pad_to_length: (b.u8() < 32).then(|| b.wild(-1, 64)),
    };
    let refs: Vec<SampleRef<'_>> = samples
        .iter()
        .zip(&u8_masks)
        .map(|(s, m8)| SampleRef {
            name: &s.name,
            tokens: &s.tokens,
            mask: match (&s.mask, s.mask_u8) {
                (Some(_), true) => Some(MaskView::U8(m8)),
                (Some(m), false) => Some(MaskView::I64(m)),
                (None, _) => None,
            },
            message_lengths: s.lengths.as_deref(),
            message_roles: s.roles.as_deref(),
        })
        .collect();
    let pm = pad_multiple(opts.pad_to_multiple_of, opts.cp_size);
    if std::env::var_os("MMPACK_FUZZ_DEBUG").is_some() {
        let lens: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
        eprintln!("{opts:?} {pm:?} {lens:?}");
    }
    // A pack of up to i32::MAX positions is a legitimate request, too big to build here.
    if let Ok(m) = pm {
        let padded: u128 = samples
            .iter()
            .map(|s| (s.tokens.len() as u128).div_ceil(m as u128) * m as u128)
            .sum();
        if padded > 1 << 22 && padded <= i32::MAX as u128 {
            return;
        }
    }
    if opts
        .pad_to_length
        .is_some_and(|l| l > 1 << 22 && l <= i64::from(i32::MAX))
    {
        return;
    }
    let got = build(&refs, &opts);
    let want = model(&samples, &opts, &u8_masks);
    match (got, want) {
        (Ok(g), Some(w)) => {
            assert_eq!(g, w);
            assert!(pm.is_ok());
            let lm: Vec<u8> = g.loss_mask.iter().map(|&b| u8::from(b)).collect();
            let tm: Vec<u8> = g.token_mask.iter().map(|&b| u8::from(b)).collect();
            let view = ThdView {
                input_ids: &g.input_ids,
                labels: &g.labels,
                loss_mask: &lm,
                token_mask: &tm,
                position_ids: &g.position_ids,
                cu_seqlens: &g.cu_seqlens,
                cu_seqlens_padded: &g.cu_seqlens_padded,
                max_seqlen: g.max_seqlen,
            };
            assert_eq!(
                check_thd(&view, opts.pad_token_id, opts.ignore_index),
                Ok(())
            );
        }
        (Err(_), None) => {}
        // A multiple past i64 (cp_size near 2^62) is refused by the builder, not the model.
        (Err(_), Some(_)) if pm.is_err() => {}
        (g, w) => unreachable!("builder {:?} vs model {:?}", g.err(), w.is_some()),
    }
}
