//! Mask validation in every dtype, span / role masks and turn-marker parsing, checked
//! against direct readings of their rules.
use mmpack_core::mask::{
    extend_from_spans, extend_validated, from_roles, trainable_roles, turn_spans, validate,
    MaskView,
};
use mmpack_core::CoreError;

use crate::bytes::Bytes;

/// Mask element values as `f64`, by dtype, for the model.
fn gen_mask(b: &mut Bytes<'_>) -> (u8, Vec<f64>) {
    let dtype = b.u8() % 7;
    let len = b.below(40);
    let mut v: Vec<f64> = (0..len)
        .map(|_| match b.u8() {
            0..=109 => 0.0,
            110..=219 => 1.0,
            220..=229 => 2.0,
            230..=234 => -1.0,
            235..=239 => 255.0,
            240..=244 => 0.5,
            245..=247 => -0.0,
            248..=249 => f64::NAN,
            250..=251 => 256.0,
            _ => 65537.0,
        })
        .collect();
    // Sometimes tile past the 4096-element chunk size of the scan.
    let tile = b.u8();
    if tile >= 200 && !v.is_empty() {
        let reps = 4200 / v.len() + usize::from(tile % 3);
        v = v.repeat(reps);
        if tile & 1 == 1 {
            let at = b.below(v.len()).min(v.len() - 1);
            v[at] = 2.0;
        }
    }
    (dtype, v)
}

struct Owned {
    u8: Vec<u8>,
    i8: Vec<i8>,
    i32: Vec<i32>,
    i64: Vec<i64>,
    f32: Vec<f32>,
    f64: Vec<f64>,
}

/// The mask in its dtype (integers wrap like a cast from a wider type), and the values the
/// model sees after that conversion.
fn materialize(dtype: u8, v: &[f64]) -> (Owned, Vec<f64>) {
    let mut o = Owned {
        u8: Vec::new(),
        i8: Vec::new(),
        i32: Vec::new(),
        i64: Vec::new(),
        f32: Vec::new(),
        f64: Vec::new(),
    };
    let seen: Vec<f64> = match dtype {
        0 | 1 => {
            o.u8 = v.iter().map(|&x| (x as i64) as u8).collect();
            o.u8.iter().map(|&x| f64::from(x)).collect()
        }
        2 => {
            o.i8 = v.iter().map(|&x| (x as i64) as i8).collect();
            o.i8.iter().map(|&x| f64::from(x)).collect()
        }
        3 => {
            o.i32 = v.iter().map(|&x| x as i32).collect();
            o.i32.iter().map(|&x| f64::from(x)).collect()
        }
        4 => {
            o.i64 = v.iter().map(|&x| x as i64).collect();
            o.i64.iter().map(|&x| x as f64).collect()
        }
        5 => {
            o.f32 = v.iter().map(|&x| x as f32).collect();
            o.f32.iter().map(|&x| f64::from(x)).collect()
        }
        _ => {
            o.f64 = v.to_vec();
            o.f64.clone()
        }
    };
    (o, seen)
}

fn view(dtype: u8, o: &Owned) -> MaskView<'_> {
    match dtype {
        0 | 1 => MaskView::U8(&o.u8),
        2 => MaskView::I8(&o.i8),
        3 => MaskView::I32(&o.i32),
        4 => MaskView::I64(&o.i64),
        5 => MaskView::F32(&o.f32),
        _ => MaskView::F64(&o.f64),
    }
}

fn check_validate(b: &mut Bytes<'_>) {
    let (dtype, raw) = gen_mask(b);
    let (owned, seen) = materialize(dtype, &raw);
    let mask = view(dtype, &owned);
    assert_eq!(mask.len(), seen.len());
    let num_tokens = if b.u8() < 200 {
        seen.len()
    } else {
        b.below(50)
    };
    let require = b.flag();
    let res = validate(mask, num_tokens, require, "'s'");
    let first_bad = seen.iter().position(|&x| x != 0.0 && x != 1.0);
    let any_one = seen.contains(&1.0);
    if seen.len() != num_tokens {
        assert!(
            matches!(res, Err(CoreError::MaskLength { expected, actual, .. })
            if expected == num_tokens && actual == seen.len())
        );
    } else if let Some(p) = first_bad {
        assert!(
            matches!(res, Err(CoreError::MaskValue { position, .. }) if position == p),
            "{res:?} want first bad at {p}"
        );
    } else if require && !any_one {
        assert!(matches!(res, Err(CoreError::MaskNoTrainable { .. })));
    } else {
        assert_eq!(res, Ok(()));
        let mut out = vec![true];
        assert_eq!(extend_validated(mask, num_tokens, "'s'", &mut out), Ok(()));
        let want: Vec<bool> = std::iter::once(true)
            .chain(seen.iter().map(|&x| x == 1.0))
            .collect();
        assert_eq!(out, want);
    }
}

fn check_spans(b: &mut Bytes<'_>) {
    let n = b.below(8);
    let lengths: Vec<i64> = (0..n).map(|_| b.wild(-1, 6)).collect();
    let n_flags = if b.u8() < 230 { n } else { b.below(9) };
    let flags: Vec<bool> = (0..n_flags).map(|_| b.flag()).collect();
    let sum: Option<i128> = lengths
        .iter()
        .try_fold(0i128, |a, &l| (l >= 0).then_some(a + i128::from(l)));
    let num_tokens = match b.u8() % 3 {
        0 => None,
        1 => sum.and_then(|s| usize::try_from(s).ok()),
        _ => Some(b.below(30)),
    };
    // Consistent spans are built when they fit; a total that cannot be allocated must be
    // refused (without a token count nothing else bounds it), never abort the process. Totals
    // that fit but are large are legitimate requests, too big to run here.
    let consistent =
        n == n_flags && sum.is_some() && num_tokens.is_none_or(|t| sum == Some(t as i128));
    let small = sum.is_some_and(|s| s <= 1 << 24);
    if consistent && !small && sum.is_some_and(|s| s < 1 << 45) {
        return;
    }
    let mut out = vec![false];
    let res = extend_from_spans(&lengths, &flags, num_tokens, "'s'", "fragment", &mut out);
    if consistent && small {
        assert_eq!(res, Ok(()));
        let mut want = vec![false];
        for (&l, &f) in lengths.iter().zip(&flags) {
            want.extend(std::iter::repeat_n(f, l as usize));
        }
        assert_eq!(out, want);
    } else {
        assert!(
            res.is_err(),
            "spans accepted: {lengths:?} {flags:?} {num_tokens:?}"
        );
    }
    // Roles.
    let names = ["user", "assistant", "system", "Assistant", ""];
    let roles: Vec<&str> = (0..n_flags).map(|_| names[b.below(5)]).collect();
    let train: Vec<&str> = (0..b.below(3)).map(|_| names[b.below(5)]).collect();
    let tr = trainable_roles(&roles, &train);
    assert_eq!(
        tr,
        roles.iter().map(|r| train.contains(r)).collect::<Vec<_>>()
    );
    {
        let m = from_roles(&lengths, &roles, &train, num_tokens, "'s'");
        let mut via = Vec::new();
        let r2 = extend_from_spans(&lengths, &tr, num_tokens, "'s'", "message", &mut via);
        assert_eq!(m.is_ok(), r2.is_ok());
        if let Ok(m) = m {
            assert_eq!(m, via);
        }
    }
}

fn check_turns(b: &mut Bytes<'_>) {
    let n = b.below(40);
    let tokens: Vec<i64> = (0..n).map(|_| b.wild(-2, 7)).collect();
    let markers: Vec<i64> = (0..b.below(4)).map(|_| b.wild(-2, 7)).collect();
    let res = turn_spans(&tokens, &markers, "'s'");
    let pos: Vec<usize> = (0..n).filter(|&i| markers.contains(&tokens[i])).collect();
    if pos.is_empty() || pos.len() % 2 == 1 {
        assert!(matches!(res, Err(CoreError::TurnMarkers { count, .. }) if count == pos.len()));
        return;
    }
    let spans = match res {
        Ok(s) => s,
        Err(e) => unreachable!("turn_spans refused {} markers: {e}", pos.len()),
    };
    assert_eq!(spans.len(), pos.len() / 2);
    for (k, s) in spans.iter().enumerate() {
        let end = pos.get(2 * k + 2).copied().unwrap_or(n);
        assert_eq!(*s, [pos[2 * k], pos[2 * k + 1], pos[2 * k + 1], end]);
        assert!(s[0] < s[1] && s[2] < s[3] && s[3] <= n);
    }
}

/// The mask fuzz check.
pub fn check(data: &[u8]) {
    let mut b = Bytes::new(data);
    match b.u8() % 3 {
        0 => check_validate(&mut b),
        1 => check_spans(&mut b),
        _ => check_turns(&mut b),
    }
}
