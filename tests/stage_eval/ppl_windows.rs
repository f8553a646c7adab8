//! The pinned window rule of `harpe eval-ppl` (`harpe::eval::ppl::windows`): S < W scores each target
//! once, S == W gives disjoint windows with each window's first token unscored (transformers'
//! perplexity recipe with stride = max_length), one window covering the document is never refused,
//! S > W is refused when a second window is needed.
use harpe::eval::ppl::windows;

/// transformers' recipe (docs "Perplexity of fixed-length models"), written out independently:
/// for begin in range(0, n, S): end = min(begin + W, n); trg_len = end - prev_end; the last trg_len
/// labels are kept and the shift drops the window's first label.
fn hf_scored_targets(n: usize, w: usize, s: usize) -> Vec<usize> {
    let (mut out, mut prev_end, mut begin) = (vec![], 0, 0);
    while begin < n {
        let end = (begin + w).min(n);
        let trg_len = end - prev_end;
        let first_label = end - trg_len;
        out.extend((first_label.max(begin + 1))..end);
        prev_end = end;
        if end == n {
            break;
        }
        begin += s;
    }
    out
}

fn scored(n: usize, w: usize, s: usize) -> Vec<usize> {
    windows(n, w, s).unwrap().into_iter().flat_map(|(_, end, lo)| lo..end).collect()
}

#[test]
fn disjoint_windows_leave_each_first_token_unscored() {
    assert_eq!(windows(10, 4, 4).unwrap(), vec![(0, 4, 1), (4, 8, 5), (8, 10, 9)]);
    assert_eq!(scored(10, 4, 4), vec![1, 2, 3, 5, 6, 7, 9]);
    // A 1-token tail has nothing to score: no empty window (its mean would be 0/0).
    assert_eq!(windows(9, 4, 4).unwrap(), vec![(0, 4, 1), (4, 8, 5)]);
}

#[test]
fn the_rule_matches_transformers_recipe_for_every_stride_up_to_the_window() {
    for n in 0..40 {
        for w in 2..12 {
            for s in 1..=w {
                assert_eq!(scored(n, w, s), hf_scored_targets(n, w, s), "n={n} W={w} S={s}");
                if s < w {
                    assert_eq!(scored(n, w, s), (1..n).collect::<Vec<_>>(), "S < W scores every target once");
                }
            }
        }
    }
}

#[test]
fn one_window_is_never_refused_and_s_above_w_is_refused_when_it_matters() {
    for s in [1, 7, 8, 9, 1000] {
        assert_eq!(windows(8, 8, s).unwrap(), vec![(0, 8, 1)], "S={s}");
    }
    let e = windows(9, 8, 9).unwrap_err().to_string();
    assert!(e.contains("--stride 9") && e.contains("unscored") && e.contains("hint:"), "{e}");
    assert!(windows(9, 8, 0).unwrap_err().to_string().contains("hint:"));
    assert!(windows(9, 1, 1).unwrap_err().to_string().contains("--window 1"));
}
