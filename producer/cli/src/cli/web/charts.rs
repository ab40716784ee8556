//! Numbers over time as inline SVG (no script, no external resource: the page's policy allows
//! neither): line charts of per-minute series read from `chime_shared::minutes`.

use chime_shared::minutes::{Minute, OUTCOMES};
use chrono::{DateTime, Utc};
use maud::{Markup, html};

use super::html::t;

const WIDTH: f64 = 560.0;
const HEIGHT: f64 = 110.0;
const LEFT: f64 = 48.0;
const BOTTOM: f64 = 18.0;

/// Colours of the series, in order.
const COLOURS: [&str; 8] =
    ["#2b7a3d", "#d08a00", "#a4161a", "#1d3557", "#6a4c93", "#1982c4", "#8ac926", "#6b7580"];

/// One line: a name and a value per minute (`None`: nothing that minute, a gap).
pub struct Series {
    pub name: String,
    pub values: Vec<Option<f64>>,
}

/// A line chart of `series` over `minutes` (one point per minute, oldest first).
pub fn chart(id: &str, title: &str, unit: &str, minutes: &[i64], series: &[Series]) -> Markup {
    let n = minutes.len().max(2);
    let max = series.iter().flat_map(|s| s.values.iter().flatten()).fold(0.0_f64, |m, v| m.max(*v));
    let top = nice(max);
    let x = |i: usize| LEFT + (WIDTH - LEFT) * i as f64 / (n - 1) as f64;
    let y = |v: f64| (HEIGHT - BOTTOM) * (1.0 - v / top);
    let time = |m: Option<&i64>| {
        m.and_then(|m| DateTime::<Utc>::from_timestamp(m * 60, 0))
            .map(|t| t.format("%H:%M").to_string())
            .unwrap_or_default()
    };
    html! {
        figure.chart id=(id) {
            figcaption { (title) }
            svg width=(WIDTH) height=(HEIGHT) viewBox={ "0 0 " (WIDTH) " " (HEIGHT) } role="img" aria-label=(title) {
                line x1=(LEFT) y1=(HEIGHT - BOTTOM) x2=(WIDTH) y2=(HEIGHT - BOTTOM) stroke="#d8dde3" {}
                line x1=(LEFT) y1="0" x2=(LEFT) y2=(HEIGHT - BOTTOM) stroke="#d8dde3" {}
                text x=(LEFT - 4.0) y="10" text-anchor="end" font-size="10" { (label(top)) }
                text x=(LEFT - 4.0) y=(HEIGHT - BOTTOM) text-anchor="end" font-size="10" { "0" }
                text x=(LEFT) y=(HEIGHT - 4.0) font-size="10" { (time(minutes.first())) " UTC" }
                text x=(WIDTH) y=(HEIGHT - 4.0) text-anchor="end" font-size="10" { (time(minutes.last())) }
                @for (s, colour) in series.iter().zip(COLOURS.iter().cycle()) {
                    @for run in runs(&s.values) {
                        @if run.len() == 1 {
                            circle cx=(x(run[0].0)) cy=(y(run[0].1)) r="1.5" fill=(colour) {}
                        } @else {
                            polyline fill="none" stroke=(colour) stroke-width="1.5"
                                points=(run.iter().map(|(i, v)| format!("{:.1},{:.1}", x(*i), y(*v))).collect::<Vec<_>>().join(" ")) {}
                        }
                    }
                }
            }
            p.legend {
                @for (s, colour) in series.iter().zip(COLOURS.iter().cycle()) {
                    span.key {
                        svg width="10" height="10" { rect width="10" height="10" fill=(colour) {} }
                        " " (t(&s.name)) ": "
                        @match s.values.iter().rev().flatten().next() {
                            Some(v) => { (label(*v)) " " (unit) " last" }
                            None => "-",
                        }
                    }
                    " "
                }
            }
        }
    }
}

/// Runs of consecutive values, as `(index, value)`.
fn runs(values: &[Option<f64>]) -> Vec<Vec<(usize, f64)>> {
    let mut out: Vec<Vec<(usize, f64)>> = Vec::new();
    let mut current = Vec::new();
    for (i, v) in values.iter().enumerate() {
        match v {
            Some(v) => current.push((i, *v)),
            None if !current.is_empty() => out.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// A round top for the axis: 1, 2 or 5 times a power of ten, at least `max`.
fn nice(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(max.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|v| *v >= max).unwrap_or(10.0 * p)
}

fn label(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The overview's charts: jobs settled per minute by outcome, enqueue → start latency, and the
/// ready messages of the work queues and DLQs (as the DLQ monitor read them).
pub fn overview(minutes: &[Minute]) -> Markup {
    let ids: Vec<i64> = minutes.iter().map(|m| m.minute).collect();
    let outcomes: Vec<Series> = OUTCOMES
        .iter()
        .map(|o| Series {
            name: o.replace('_', " "),
            values: minutes
                .iter()
                .map(|m| Some(m.counts.outcomes.get(*o).copied().unwrap_or(0) as f64))
                .collect(),
        })
        .collect();
    let latency: Vec<Series> = [("p50", 0.5), ("p99", 0.99)]
        .iter()
        .map(|(name, q)| Series {
            name: name.to_string(),
            values: minutes.iter().map(|m| m.counts.latency_quantile_ms(*q).map(|v| v as f64)).collect(),
        })
        .collect();
    let queues: std::collections::BTreeSet<&String> = minutes.iter().flat_map(|m| m.depths.keys()).collect();
    let mut depths: Vec<Series> = queues
        .into_iter()
        .take(6)
        .map(|q| Series {
            name: q.clone(),
            values: minutes.iter().map(|m| m.depths.get(q).map(|d| *d as f64)).collect(),
        })
        .collect();
    depths.push(Series {
        name: "dead letters (all DLQs)".into(),
        values: minutes
            .iter()
            .map(|m| (!m.dlq_depths.is_empty()).then(|| m.dlq_depths.values().sum::<u64>() as f64))
            .collect(),
    });
    html! {
        div.charts {
            (chart("chart-outcomes", "Jobs settled per minute", "/min", &ids, &outcomes))
            (chart("chart-latency", "Enqueue → start latency (bucket bound, ms)", "ms", &ids, &latency))
            (chart("chart-depths", "Ready messages", "", &ids, &depths))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_draws_gaps_as_gaps_and_names_its_series() {
        let s = Series { name: "<q>".into(), values: vec![Some(1.0), Some(3.0), None, Some(2.0), None] };
        assert_eq!(runs(&s.values), vec![vec![(0, 1.0), (1, 3.0)], vec![(3, 2.0)]]);
        let svg = chart("c", "T", "/min", &[0, 1, 2, 3, 4], &[s]).into_string();
        assert_eq!(svg.matches("<polyline").count(), 1, "{svg}");
        assert_eq!(svg.matches("<circle").count(), 1, "{svg}");
        assert!(svg.contains("&lt;q&gt;: 2 /min last") && !svg.contains("<q>"), "{svg}");
        assert_eq!((nice(0.0), nice(3.0), nice(12.0), nice(100.0)), (1.0, 5.0, 20.0, 100.0));
    }
}
