//! HTML building blocks: escaping, URL encoding, the page layout, tables and forms. Every
//! value that did not come from this file goes through [`esc`] or [`enc`].

use chrono::{DateTime, Utc};
use std::fmt::Write;

/// `s` escaped for HTML text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
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

/// The first `n` characters of `s` on one line, with an ellipsis when cut (escaped).
pub fn cut(s: &str, n: usize) -> String {
    let one_line = s.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= n {
        esc(&one_line)
    } else {
        esc(&format!("{}…", one_line.chars().take(n.saturating_sub(1)).collect::<String>()))
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
dt{font-weight:600}dd{margin:0}";

/// A whole page: header with navigation, the notice, then `body`. `refresh` reloads the page
/// every so many seconds (the live pages).
pub fn page(frame: &Frame, title: &str, active: &str, refresh: Option<u32>, body: &str) -> String {
    let mut nav = String::new();
    for (href, label) in [
        ("/", "Overview"),
        ("/schedules", "Schedules"),
        ("/running", "Running"),
        ("/history", "History"),
        ("/dlq", "Dead letters"),
    ] {
        let class = if label == active { " class=\"on\"" } else { "" };
        let _ = write!(nav, "<a href=\"{href}\"{class}>{label}</a>");
    }
    let refresh =
        refresh.map(|s| format!("<meta http-equiv=\"refresh\" content=\"{s}\">")).unwrap_or_default();
    let notice = frame
        .notice
        .as_deref()
        .map(|n| format!("<div class=\"notice\" id=\"notice\">{}</div>", esc(n)))
        .unwrap_or_default();
    let mode = if frame.read_only { "<span class=\"muted\">read-only</span>" } else { "" };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">{refresh}\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{title} · chime {prefix}</title>\
         <style>{STYLE}</style></head><body><header><b>chime</b><span>{prefix}</span>{nav}{mode}</header>\
         <main><h1>{title}</h1>{notice}{body}</main></body></html>",
        title = esc(title),
        prefix = esc(frame.prefix),
    )
}

/// A POST button (hidden when read-only) carrying the CSRF token, where to come back to, and
/// `fields`.
pub fn button(
    frame: &Frame,
    action: &str,
    label: &str,
    back: &str,
    fields: &[(&str, &str)],
    danger: bool,
) -> String {
    if frame.read_only {
        return String::new();
    }
    let mut hidden = String::new();
    for (k, v) in fields {
        let _ = write!(hidden, "<input type=\"hidden\" name=\"{}\" value=\"{}\">", esc(k), esc(v));
    }
    let class = if danger { " class=\"danger\"" } else { "" };
    format!(
        "<form class=\"inline\" method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         <input type=\"hidden\" name=\"back\" value=\"{}\">{hidden}<button type=\"submit\"{class}>{}</button></form>",
        esc(action),
        esc(frame.csrf),
        esc(back),
        esc(label)
    )
}

/// A table: `head` names the columns; columns listed in `numeric` align right. Cells are HTML.
pub fn table(id: &str, head: &[&str], numeric: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("<table id=\"{}\"><thead><tr>", esc(id));
    for h in head {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for (cell, h) in row.iter().zip(head) {
            let class = if numeric.contains(h) { " class=\"n\"" } else { "" };
            let _ = write!(out, "<td{class}>{cell}</td>");
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_leaves_no_markup_and_no_control_bytes() {
        assert_eq!(
            esc("<script>alert('x')</script>&\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
        assert_eq!(esc("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(enc("a b/c?d=e&f"), "a%20b%2Fc%3Fd%3De%26f");
        assert_eq!(enc("0196-ab_c.d~"), "0196-ab_c.d~");
        assert_eq!(cut("line one\nline two", 8), "line on…");
    }

    #[test]
    fn read_only_pages_have_no_forms() {
        let f = Frame { prefix: "p", read_only: true, csrf: "t", notice: None };
        assert_eq!(button(&f, "/x", "Go", "/", &[], false), "");
        let f = Frame { read_only: false, ..f };
        let b = button(&f, "/x", "Go", "/back", &[("id", "a\"b")], true);
        assert!(b.contains("name=\"csrf\" value=\"t\"") && b.contains("value=\"a&quot;b\""), "{b}");
    }
}
