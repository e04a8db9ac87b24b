use super::*;
use proptest::prelude::*;

fn opts(mode: MaskMode, roles: &[String], pad: i64, cp: i64) -> BatchOptions {
    BatchOptions {
        mode,
        train_roles: roles.to_vec(),
        pad_token_id: 0,
        pad_to_multiple_of: pad,
        ignore_index: -100,
        cp_size: cp,
        pad_to_length: None,
    }
}

fn pre<'a>(name: &'a str, tokens: &'a [i64], mask: &'a [u8]) -> SampleRef<'a> {
    SampleRef {
        name,
        tokens,
        mask: Some(MaskView::U8(mask)),
        message_lengths: None,
        message_roles: None,
    }
}

fn bytes(v: &[bool]) -> Vec<u8> {
    v.iter().map(|&b| u8::from(b)).collect()
}

fn view<'a>(out: &'a ThdLayout, lm: &'a [u8], tm: &'a [u8]) -> ThdView<'a> {
    ThdView {
        input_ids: &out.input_ids,
        labels: &out.labels,
        loss_mask: lm,
        token_mask: tm,
        position_ids: &out.position_ids,
        cu_seqlens: &out.cu_seqlens,
        cu_seqlens_padded: &out.cu_seqlens_padded,
        max_seqlen: out.max_seqlen,
    }
}

fn check_built(out: &ThdLayout, pad: i64, ignore: i64) -> CoreResult<()> {
    let (lm, tm) = (bytes(&out.loss_mask), bytes(&out.token_mask));
    check_thd(&view(out, &lm, &tm), pad, ignore)
}

#[test]
fn worked_example_both_modes() {
    let tokens = [11i64, 12, 13, 14, 21, 22, 23];
    let mask = [0u8, 0, 0, 0, 1, 1, 1];
    let roles = vec!["user".to_owned(), "assistant".to_owned()];
    let train = vec!["assistant".to_owned()];
    let der = SampleRef {
        name: "'s0'",
        tokens: &tokens,
        mask: None,
        message_lengths: Some(&[4, 3]),
        message_roles: Some(&roles),
    };
    let a = build(
        &[pre("'s0'", &tokens, &mask)],
        &opts(MaskMode::Precomputed, &train, 1, 1),
    );
    let b = build(&[der], &opts(MaskMode::Derived, &train, 1, 1));
    assert!(a.is_ok());
    assert_eq!(a, b);
    if let Ok(a) = a {
        let t = [false, false, false, false, true, true, true];
        assert_eq!(a.token_mask, t);
        assert_eq!(a.labels, vec![-100, -100, -100, 21, 22, 23, -100]);
        // aligned with labels: the predictions of tokens 4, 5 and 6, made at 3, 4 and 5
        assert_eq!(
            a.loss_mask,
            vec![false, false, false, true, true, true, false]
        );
        assert_eq!(a.cu_seqlens, vec![0, 7]);
        assert!(check_built(&a, 0, -100).is_ok());
    }
}

#[test]
fn a_trainable_first_token_is_never_a_prediction() {
    // The first token has no context inside its sample: loss_mask counts only real predictions.
    let t1 = [5i64, 6, 7];
    let t2 = [8i64, 9];
    let s = [pre("a", &t1, &[1, 1, 1]), pre("b", &t2, &[1, 1])];
    let out = build(&s, &opts(MaskMode::Precomputed, &[], 1, 1));
    assert!(out.is_ok());
    if let Ok(out) = out {
        assert_eq!(out.token_mask.iter().filter(|&&b| b).count(), 5);
        assert_eq!(out.loss_mask.iter().filter(|&&b| b).count(), 3);
        assert_eq!(out.labels, vec![6, 7, -100, 9, -100]);
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
    let m2 = [1i64, 1, 1, 1, 1];
    let s = [
        pre("a", &t1, &[1, 1, 1]),
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
        assert!(check_built(&out, 0, -100).is_ok());
    }
}

#[test]
fn pad_to_length_is_absorbed_by_the_last_sample() {
    let t1 = [1i64, 2, 3];
    let t2 = [4i64, 5];
    let s = [pre("a", &t1, &[0, 1, 1]), pre("b", &t2, &[0, 1])];
    let mut o = opts(MaskMode::Precomputed, &[], 1, 2);
    o.pad_to_length = Some(16);
    let out = build(&s, &o);
    assert!(out.is_ok());
    if let Ok(out) = out {
        assert_eq!(out.cu_seqlens, vec![0, 3, 5]);
        assert_eq!(out.cu_seqlens_padded, vec![0, 4, 16]);
        assert_eq!(out.max_seqlen, 12);
        assert_eq!(out.position_ids[4..], (0..12).collect::<Vec<i64>>());
        assert!(check_built(&out, 0, -100).is_ok());
    }
    for (length, needle) in [(6, "multiple of 4"), (4, "needs 8 positions"), (0, ">= 1")] {
        o.pad_to_length = Some(length);
        let err = build(&s, &o)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("pad_to_length") && err.contains(needle),
            "{err}"
        );
    }
}

#[test]
fn padded_rows_take_their_attention_mask_from_the_lengths() {
    // pad = eos = 2: the mask must keep the real eos tokens.
    let t1 = [7i64, 2, 5, 2];
    let t2 = [9i64, 2];
    let s = [pre("a", &t1, &[0, 0, 1, 1]), pre("b", &t2, &[1, 1])];
    let mut o = opts(MaskMode::Precomputed, &[], 1, 1);
    o.pad_token_id = 2;
    let out = build_padded(&s, &o);
    assert!(out.is_ok());
    let Ok(out) = out else { return };
    assert_eq!((out.rows, out.width), (2, 4));
    assert_eq!(out.input_ids, vec![7, 2, 5, 2, 9, 2, 2, 2]);
    assert_eq!(bytes(&out.attention_mask), vec![1, 1, 1, 1, 1, 1, 0, 0]);
    assert_eq!(out.labels, vec![-100, 5, 2, -100, 2, -100, -100, -100]);
    assert_eq!(bytes(&out.loss_mask), vec![0, 1, 1, 0, 1, 0, 0, 0]);
    assert_eq!(bytes(&out.token_mask), vec![0, 0, 1, 1, 1, 1, 0, 0]);
    assert_eq!(out.position_ids, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(out.lengths, vec![4, 2]);
    let (lm, tm, am) = (
        bytes(&out.loss_mask),
        bytes(&out.token_mask),
        bytes(&out.attention_mask),
    );
    let v = PaddedView {
        rows: out.rows,
        width: out.width,
        input_ids: &out.input_ids,
        labels: &out.labels,
        loss_mask: &lm,
        token_mask: &tm,
        position_ids: &out.position_ids,
        attention_mask: &am,
        lengths: &out.lengths,
    };
    assert!(check_padded(&v, 2, -100).is_ok());
    // the old rule (input_ids != pad) would mask out the real eos tokens
    let wrong: Vec<u8> = out.input_ids.iter().map(|&t| u8::from(t != 2)).collect();
    let err = check_padded(
        &PaddedView {
            attention_mask: &wrong,
            ..v
        },
        2,
        -100,
    );
    assert!(matches!(err, Err(CoreError::BatchLayout { .. })));
    o.pad_to_multiple_of = 8;
    assert_eq!(build_padded(&s, &o).map(|p| p.width).ok(), Some(8));
    o.pad_to_length = Some(16);
    assert_eq!(build_padded(&s, &o).map(|p| p.width).ok(), Some(16));
    o.pad_to_length = Some(12);
    assert!(build_padded(&s, &o).is_err()); // not a multiple of 8
}

#[test]
fn options_that_break_the_fields_are_refused() {
    let t = [3i64, 4, 5];
    let s = [pre("x", &t, &[0, 1, 1])];
    let mut o = opts(MaskMode::Precomputed, &[], 1, 1);
    o.pad_token_id = -1;
    assert!(matches!(
        build(&s, &o),
        Err(CoreError::BatchOption {
            name: "pad_token_id",
            ..
        })
    ));
    o.pad_token_id = 0;
    for ii in [0, 4, 5] {
        o.ignore_index = ii;
        let err = build(&s, &o);
        assert!(
            matches!(err, Err(CoreError::BatchOption { name: "ignore_index", ref detail }) if detail.contains("sample x")),
            "{err:?}"
        );
        assert!(build_padded(&s, &o).is_err());
    }
    o.ignore_index = 6; // past every token id of the batch
    assert!(build(&s, &o).is_ok());
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
    assert!(matches!(build_padded(&[], &o), Err(CoreError::EmptyBatch)));
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

#[test]
fn check_names_each_disagreement() {
    let t1 = [1i64, 2, 3];
    let t2 = [4i64, 5];
    let s = [pre("a", &t1, &[1, 1, 1]), pre("b", &t2, &[0, 1])];
    let Ok(good) = build(&s, &opts(MaskMode::Precomputed, &[], 4, 1)) else {
        unreachable!("build failed")
    };
    let (lm, tm) = (bytes(&good.loss_mask), bytes(&good.token_mask));
    let v = view(&good, &lm, &tm);
    let err = |v: ThdView<'_>| check_thd(&v, 0, -100).err().map(|e| e.to_string());
    assert_eq!(err(v), None);
    // the input-aligned mask given as loss_mask
    assert!(err(ThdView {
        loss_mask: &tm,
        ..v
    })
    .is_some_and(|e| e.contains("loss_mask[")));
    let mut labels = good.labels.clone();
    labels[2] = 4; // across the sample boundary
    assert!(err(ThdView {
        labels: &labels,
        ..v
    })
    .is_some_and(|e| e.contains("labels[2] (sample 0, position 2)")));
    let mut pos = good.position_ids.clone();
    pos[4] = 4; // positions must restart
    assert!(err(ThdView {
        position_ids: &pos,
        ..v
    })
    .is_some_and(|e| e.contains("position_ids[4]")));
    let mut ids = good.input_ids.clone();
    ids[3] = 9; // padding that is not pad_token_id
    assert!(err(ThdView {
        input_ids: &ids,
        ..v
    })
    .is_some_and(|e| e.contains("pad_token_id")));
    assert!(err(ThdView { max_seqlen: 3, ..v }).is_some_and(|e| e.contains("max_seqlen")));
    let mut odd = tm.clone();
    odd[0] = 2;
    assert!(err(ThdView {
        token_mask: &odd,
        ..v
    })
    .is_some_and(|e| e.contains("byte 2")));
    assert!(err(ThdView {
        cu_seqlens: &[0, 3, 9],
        ..v
    })
    .is_some_and(|e| e.contains("sample 1 has 6 tokens in 4")));
    assert!(check_thd(&v, 0, 3).is_err()); // a token id as ignore_index
    assert!(check_thd(&v, -1, -100).is_err());
}

#[test]
fn packs_join_into_one_micro_batch() {
    let t1 = [1i64, 2, 3];
    let t2 = [4i64, 5];
    let t3 = [6i64, 7, 8, 9, 10];
    let o = opts(MaskMode::Precomputed, &[], 1, 2);
    let one = build(&[pre("a", &t1, &[0, 1, 1]), pre("b", &t2, &[0, 1])], &o);
    let two = build(&[pre("c", &t3, &[0, 0, 1, 1, 1])], &o);
    let all = build(
        &[
            pre("a", &t1, &[0, 1, 1]),
            pre("b", &t2, &[0, 1]),
            pre("c", &t3, &[0, 0, 1, 1, 1]),
        ],
        &o,
    );
    let (Ok(one), Ok(two), Ok(all)) = (one, two, all) else {
        unreachable!("build failed")
    };
    let (lm1, tm1, lm2, tm2) = (
        bytes(&one.loss_mask),
        bytes(&one.token_mask),
        bytes(&two.loss_mask),
        bytes(&two.token_mask),
    );
    let parts = [view(&one, &lm1, &tm1), view(&two, &lm2, &tm2)];
    let c = BatchOptions {
        pad_to_multiple_of: 4,
        ..BatchOptions::default()
    };
    assert_eq!(concat(&parts, &c).ok(), Some(all.clone()));
    let padded = concat(
        &parts,
        &BatchOptions {
            pad_to_length: Some(24),
            ..c.clone()
        },
    );
    let Ok(padded) = padded else {
        unreachable!("concat failed")
    };
    assert_eq!(padded.cu_seqlens, all.cu_seqlens);
    assert_eq!(padded.cu_seqlens_padded, vec![0, 4, 8, 24]);
    assert_eq!(padded.max_seqlen, 16);
    assert!(check_built(&padded, 0, -100).is_ok());
    // packs not padded for the micro-batch's context parallelism
    let err = concat(
        &parts,
        &BatchOptions {
            pad_to_multiple_of: 8,
            ..c.clone()
        },
    );
    assert!(
        matches!(err, Err(CoreError::BatchLayout { ref detail }) if detail.starts_with("packs[0]"))
    );
    assert!(concat(
        &parts,
        &BatchOptions {
            pad_to_length: Some(12),
            ..c.clone()
        }
    )
    .is_err());
    assert!(matches!(concat(&[], &c), Err(CoreError::EmptyBatch)));
    // options are checked before the packs
    let bad = BatchOptions {
        pad_to_length: Some(6),
        ..c.clone()
    };
    assert!(matches!(
        concat(&parts, &bad),
        Err(CoreError::BatchOption {
            name: "pad_to_length",
            ..
        })
    ));
}

#[test]
fn options_validate_alone() {
    assert_eq!(BatchOptions::default().validate(), Ok(()));
    let bad = |o: BatchOptions| match o.validate() {
        Err(CoreError::BatchOption { name, .. }) => Some(name),
        _ => None,
    };
    let d = BatchOptions::default;
    assert_eq!(
        bad(BatchOptions {
            pad_token_id: -1,
            ..d()
        }),
        Some("pad_token_id")
    );
    assert_eq!(
        bad(BatchOptions {
            pad_to_multiple_of: 0,
            ..d()
        }),
        Some("pad_to_multiple_of")
    );
    assert_eq!(bad(BatchOptions { cp_size: 0, ..d() }), Some("cp_size"));
    assert_eq!(
        bad(BatchOptions {
            pad_to_length: Some(0),
            ..d()
        }),
        Some("pad_to_length")
    );
    let cp2 = BatchOptions {
        cp_size: 2,
        pad_to_length: Some(6),
        ..d()
    };
    assert_eq!(bad(cp2), Some("pad_to_length"));
}

/// Sizes a caller chose that no batch can have: each a `BatchOption` naming the option (or
/// `IndexOverflow` when the samples themselves are too many), never an abort.
#[test]
fn size_options_are_checked_before_allocating() {
    let tokens = [5i64, 6, 7];
    let mask = [1u8, 1, 1];
    let one = [pre("'s'", &tokens, &mask)];
    fn named<T>(r: CoreResult<T>) -> Option<&'static str> {
        match r {
            Err(CoreError::BatchOption { name, .. }) => Some(name),
            _ => None,
        }
    }
    let with = |multiple: i64, cp: i64, length: Option<i64>| BatchOptions {
        pad_to_length: length,
        ..opts(MaskMode::Precomputed, &[], multiple, cp)
    };
    let pre_opts = with(1, 1, None);
    let packed = build(&one, &pre_opts).ok();
    assert!(packed.is_some(), "a 3-token pack builds");
    let Some(packed) = packed else {
        return;
    };
    let (lm, tm) = (bytes(&packed.loss_mask), bytes(&packed.token_mask));
    let parts = [view(&packed, &lm, &tm)];
    for huge in [1i64 << 31, 1 << 40, 1 << 42, i64::MAX] {
        // THD offsets are int32
        assert_eq!(
            named(build(&one, &with(1, 1, Some(huge)))),
            Some("pad_to_length")
        );
        assert_eq!(
            named(concat(&parts, &with(1, 1, Some(huge)))),
            Some("pad_to_length")
        );
        assert_eq!(
            named(build(&one, &with(huge, 1, None))),
            Some("pad_to_multiple_of")
        );
        assert_eq!(named(build(&one, &with(1, huge, None))), Some("cp_size"));
    }
    // (sizes whose bytes overflow usize: refused whatever the machine's memory)
    for huge in [1i64 << 61, i64::MAX] {
        let o = with(1, 1, Some(huge));
        assert_eq!(named(build_padded(&one, &o)), Some("pad_to_length"));
        assert_eq!(
            named(build_padded(&one, &with(huge, 1, None))),
            Some("pad_to_multiple_of")
        );
        assert_eq!(
            named(build_padded(&one, &with(1, huge, None))),
            Some("cp_size")
        );
    }
    // rows * width past usize with a modest width: blamed on the padding that made it so
    let many: Vec<SampleRef<'_>> = std::iter::repeat_n(one[0], 1 << 20).collect();
    assert_eq!(
        named(build_padded(&many, &with(1 << 50, 1, None))),
        Some("pad_to_multiple_of")
    );
}

proptest! {
    /// Layout invariants for random precomputed-mask samples and options; every layout built
    /// passes the checker.
    #[test]
    fn layout_invariants(
        lens in proptest::collection::vec(1usize..40, 1..8),
        pad in 1i64..9,
        cp in 1i64..4,
        extra in 0usize..3,
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
            .map(|(t, m)| pre("p", t, m))
            .collect();
        let multiple = pad_multiple(pad, cp).unwrap_or(1);
        let natural: usize = lens.iter().map(|&n| n.div_ceil(multiple) * multiple).sum();
        let mut opts = opts(MaskMode::Precomputed, &[], pad, cp);
        opts.pad_to_length = (extra > 0)
            .then(|| i64::try_from(natural + (extra - 1) * multiple).unwrap_or(0));
        let out = build(&samples, &opts);
        prop_assert!(out.is_ok());
        let Ok(out) = out else { return Ok(()) };
        prop_assert!(check_built(&out, 0, -100).is_ok());
        let total = usize::try_from(*out.cu_seqlens_padded.last().unwrap_or(&0)).unwrap_or(0);
        prop_assert_eq!(out.input_ids.len(), total);
        for (i, w) in out.cu_seqlens_padded.windows(2).enumerate() {
            let (Some(&a), Some(&b)) = (w.first(), w.get(1)) else { continue };
            let width = usize::try_from(b - a).unwrap_or(0);
            prop_assert_eq!(width % multiple, 0);
            let n = lens.get(i).copied().unwrap_or(0);
            prop_assert!(width >= n);
            // labels: next token where the target's mask is 1; loss_mask: labels trained
            let start = usize::try_from(a).unwrap_or(0);
            for p in 0..width {
                let got = out.labels.get(start + p).copied();
                let target = masks.get(i).and_then(|m| m.get(p + 1)).copied();
                let want = if p + 1 < n && target == Some(1) {
                    tokens.get(i).and_then(|t| t.get(p + 1)).copied()
                } else {
                    Some(-100)
                };
                prop_assert_eq!(got, want);
                prop_assert_eq!(out.loss_mask.get(start + p).copied(), Some(want != Some(-100)));
                let own = masks.get(i).and_then(|m| m.get(p)).copied() == Some(1);
                prop_assert_eq!(out.token_mask.get(start + p).copied(), Some(own && p < n));
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
