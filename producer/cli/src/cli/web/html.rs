//! The dashboard's markup: maud templates (escaped by default: a value can only reach the
//! page as text, never as markup), the layout, tables and forms, and how values are shown.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, Render, html};
use std::fmt::Write;

/// Text from outside (Redis, the DLQ, the config): control characters shown as escapes
/// (`\u{1b}`), then HTML-escaped like any value.
pub struct Text<'a>(pub &'a str);

impl Render for Text<'_> {
    fn render_to(&self, buffer: &mut String) {
        chime_shared::redact::escape_control(self.0).as_ref().render_to(buffer);
    }
}

/// Shorthand for [`Text`].
pub fn t(s: &str) -> Text<'_> {
    Text(s)
}

/// `s` percent-encoded for a URL path segment or query value.
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A timestamp as the pages show it (UTC, milliseconds).
pub fn at(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

/// How long ago `t` was, short ("3s", "4m", "2h", "5d").
pub fn ago(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let s = (now - t).num_seconds();
    match s {
        s if s < 0 => "in the future".into(),
        s if s < 120 => format!("{s}s ago"),
        s if s < 7200 => format!("{}m ago", s / 60),
        s if s < 172_800 => format!("{}h ago", s / 3600),
        s => format!("{}d ago", s / 86_400),
    }
}

/// The first `n` characters of `s` on one line, with an ellipsis when cut.
pub fn cut(s: &str, n: usize) -> String {
    let one_line = s.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n.saturating_sub(1)).collect::<String>())
    }
}

/// What a page needs from its request for the shared parts of the layout.
pub struct Frame<'a> {
    pub prefix: &'a str,
    pub read_only: bool,
    pub csrf: &'a str,
    /// A notice from the action that redirected here.
    pub notice: Option<String>,
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d232a;background:#f6f7f9}\
header{background:#1d3557;color:#fff;padding:.6em 1em;display:flex;gap:1.2em;align-items:baseline;flex-wrap:wrap}\
header a{color:#fff;text-decoration:none}header a.on{text-decoration:underline}header b{font-size:1.1em}\
main{padding:1em 1.4em}table{border-collapse:collapse;background:#fff;margin:.4em 0 1.2em;min-width:40%}\
th,td{border:1px solid #d8dde3;padding:.3em .6em;text-align:left;vertical-align:top}th{background:#eef1f4}\
td.n{text-align:right;font-variant-numeric:tabular-nums}code,pre{font:12px ui-monospace,monospace}\
pre{background:#fff;border:1px solid #d8dde3;padding:.6em;overflow:auto;max-height:30em}\
.notice{background:#e7f5e9;border:1px solid #9ccfa4;padding:.5em .8em;margin-bottom:1em}\
.warn{color:#a4161a;font-weight:600}.ok{color:#2b7a3d}.muted{color:#6b7580}\
form.inline{display:inline;margin:0}button{cursor:pointer}button.danger{color:#a4161a}\
form.filter input,form.filter select{margin-right:.6em}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}\
dt{font-weight:600}dd{margin:0}\
.charts{display:flex;flex-wrap:wrap;gap:1em}figure.chart{margin:0;background:#fff;border:1px solid #d8dde3;padding:.4em}\
figcaption{font-weight:600}.legend{margin:.2em 0 0;font-size:12px}td code{white-space:nowrap}";

/// The navigation: path and label.
const NAV: [(&str, &str); 5] = [
    ("/", "Overview"),
    ("/schedules", "Schedules"),
    ("/running", "Running"),
    ("/history", "History"),
    ("/dlq", "Dead letters"),
];

/// A whole page: header with navigation, the notice, then `body`. `refresh` reloads the page
/// every so many seconds (the live pages).
pub fn page(frame: &Frame, title: &str, active: &str, refresh: Option<u32>, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if let Some(s) = refresh { meta http-equiv="refresh" content=(s); }
                meta name="viewport" content="width=device-width";
                title { (t(title)) " · chime " (t(frame.prefix)) }
                // A constant of this file: the one text not escaped.
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    b { "chime" }
                    span { (t(frame.prefix)) }
                    @for (href, label) in NAV {
                        a href=(href) class=[(label == active).then_some("on")] { (label) }
                    }
                    @if frame.read_only { span.muted { "read-only" } }
                }
                main {
                    h1 { (t(title)) }
                    @if let Some(n) = &frame.notice { div.notice #notice { (t(n)) } }
                    (body)
                }
            }
        }
    }
    .into_string()
}

/// A POST button (nothing when read-only) carrying the CSRF token, where to come back to, and
/// `fields`.
pub fn button(
    frame: &Frame,
    action: &str,
    label: &str,
    back: &str,
    fields: &[(&str, &str)],
    danger: bool,
) -> Markup {
    html! {
        @if !frame.read_only {
            form.inline method="post" action=(action) {
                input type="hidden" name="csrf" value=(frame.csrf);
                input type="hidden" name="back" value=(back);
                @for (k, v) in fields { input type="hidden" name=(k) value=(v); }
                button type="submit" class=[danger.then_some("danger")] { (label) }
            }
        }
    }
}

/// A table: `head` names the columns; columns listed in `numeric` align right.
pub fn table(id: &str, head: &[&str], numeric: &[&str], rows: &[Vec<Markup>]) -> Markup {
    html! {
        table id=(id) {
            thead { tr { @for h in head { th { (h) } } } }
            tbody {
                @for row in rows {
                    tr {
                        @for (cell, h) in row.iter().zip(head) {
                            td class=[numeric.contains(h).then_some("n")] { (cell) }
                        }
                    }
                }
            }
        }
    }
}

/// A link to a key's page (`-` for none).
pub fn key_link(key: &str) -> Markup {
    html! {
        @if key.is_empty() { "-" } @else { a href={ "/keys/" (enc(key)) } { code { (t(key)) } } }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_reach_the_page_as_text_never_as_markup() {
        let f = Frame { prefix: "<p>", read_only: false, csrf: "t", notice: Some("<b>'x'&\"".into()) };
        let body = html! { p { (t("a\u{1b}[31mb <script>")) } };
        let page = page(&f, "<title>", "Overview", None, body);
        assert!(
            !page.contains("<script>") && !page.contains("<b>'x'") && !page.contains("<title><"),
            "{page}"
        );
        assert!(
            page.contains("&lt;b&gt;'x'&amp;&quot;") && page.contains("a\\u{1b}[31mb &lt;script&gt;"),
            "{page}"
        );
        assert_eq!(enc("a b/c?d=e&f"), "a%20b%2Fc%3Fd%3De%26f");
        assert_eq!(enc("0196-ab_c.d~"), "0196-ab_c.d~");
        assert_eq!(cut("line one\nline two", 8), "line on…");
        let cells = vec![vec![html! { (t("<i>")) }, html! { "1" }]];
        let table = table("x\"y", &["A", "N"], &["N"], &cells).into_string();
        assert_eq!(
            table,
            "<table id=\"x&quot;y\"><thead><tr><th>A</th><th>N</th></tr></thead><tbody><tr><td>&lt;i&gt;</td>\
             <td class=\"n\">1</td></tr></tbody></table>"
        );
    }

    #[test]
    fn read_only_pages_have_no_forms() {
        let f = Frame { prefix: "p", read_only: true, csrf: "t", notice: None };
        assert_eq!(button(&f, "/x", "Go", "/", &[], false).into_string(), "");
        let f = Frame { read_only: false, ..f };
        let b = button(&f, "/x", "Go", "/back", &[("id", "a\"b")], true).into_string();
        assert!(b.contains("name=\"csrf\" value=\"t\"") && b.contains("value=\"a&quot;b\""), "{b}");
    }
}
