//! What text may leave the process: secrets in URLs masked, control characters escaped.
//!
//! Every log line, error message, `x-chime-error` header, history event, dashboard page and
//! webhook body that can hold a URL passes it through [`redact`] (or [`redact_text`] for
//! free text). A URL keeps its scheme, host, port and the shape of its path; these become `***`:
//! - the password of `user:password@`, and a userinfo without a password (`https://TOKEN@host`,
//!   as GitHub and many APIs use it) as a whole;
//! - every query value and the fragment;
//! - every path segment that looks like a token ([`looks_secret`]): Slack, Discord and Teams
//!   webhooks, and many others, carry their secret in the path.

use std::borrow::Cow;

/// A URL with its secrets masked: `amqp://chime:***@host/vh`,
/// `https://***@api.example/x?api_key=***`, `https://hooks.slack.com/services/T0/B0/***`.
pub fn redact(url: &str) -> String {
    let (base, fragment) = match url.split_once('#') {
        Some((b, _)) => (b, "#***"),
        None => (url, ""),
    };
    let (base, query) = match base.split_once('?') {
        Some((b, q)) => {
            let masked: Vec<String> = q
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) => format!("{}=***", mask_segment(k)),
                    None => mask_segment(pair).into_owned(),
                })
                .collect();
            (b, format!("?{}", masked.join("&")))
        }
        None => (base, String::new()),
    };
    let (scheme, rest) = match base.find("://") {
        Some(s) => (&base[..s + 3], &base[s + 3..]),
        None => ("", base),
    };
    let (authority, path) = match rest.find('/') {
        Some(p) => (&rest[..p], &rest[p..]),
        None => (rest, ""),
    };
    let authority = match authority.rfind('@') {
        Some(at) => match authority[..at].find(':') {
            Some(c) => format!("{}:***{}", &authority[..c], &authority[at..]),
            None => format!("***{}", &authority[at..]),
        },
        None => authority.to_string(),
    };
    let path: Vec<Cow<'_, str>> = path.split('/').map(mask_segment).collect();
    format!("{scheme}{authority}{}{query}{fragment}", path.join("/"))
}

fn mask_segment(segment: &str) -> Cow<'_, str> {
    if looks_secret(segment) { Cow::Borrowed("***") } else { Cow::Borrowed(segment) }
}

/// Whether a path segment (or a lone query word) looks like a token rather than a name: 16 or
/// more letters and digits mixing at least two of lowercase, uppercase and digits
/// (`xoxb…`, `ghp_…`, hex and base64 secrets, UUIDs), or 32 or more of any kind. Names such
/// as `services`, `IncomingWebhook`, `notifications-service` or an 18-digit id stay.
pub fn looks_secret(segment: &str) -> bool {
    let alnum = segment.chars().filter(char::is_ascii_alphanumeric).count();
    let classes = [
        segment.chars().any(|c| c.is_ascii_lowercase()),
        segment.chars().any(|c| c.is_ascii_uppercase()),
        segment.chars().any(|c| c.is_ascii_digit()),
    ]
    .iter()
    .filter(|&&x| x)
    .count();
    (alnum >= 16 && classes >= 2) || alnum >= 32
}

/// [`redact`] applied to every URL inside a free text (an error message, a header): a URL
/// runs from its scheme to the next white space or quote.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        // The scheme starts after the last character that cannot be part of one (which may
        // be several bytes long).
        let start = rest[..i]
            .char_indices()
            .rfind(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.'))
            .map_or(0, |(j, c)| j + c.len_utf8());
        let end = rest[i..]
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`' || c == '<' || c == '>')
            .map_or(rest.len(), |j| i + j);
        out.push_str(&rest[..start]);
        out.push_str(&redact(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

pub use chime_protocol::escape_control;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn passwords_tokens_and_query_values_are_masked() {
        assert_eq!(redact("amqp://guest:secret@h:5672/%2f"), "amqp://guest:***@h:5672/%2f");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact("https://api.example/hook?api_key=s3cret&x=1"),
            "https://api.example/hook?api_key=***&x=***"
        );
        assert_eq!(redact("https://u:p@h/p?token=t#frag"), "https://u:***@h/p?token=***#***");
        assert_eq!(
            redact("http://ghp_16C7e42F292c6912E7710c838347Ae178B4a@host/x"),
            "http://***@host/x",
            "a userinfo without a password is a token"
        );
        assert_eq!(
            redact("https://hooks.slack.com/services/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"),
            "https://hooks.slack.com/services/T0123ABCD/B0456EFGH/***"
        );
        assert_eq!(
            redact(
                "https://discord.com/api/webhooks/123456789012345678/Ab-cD_efGhIjKlMnOpQrStUvWxYz0123456789"
            ),
            "https://discord.com/api/webhooks/123456789012345678/***"
        );
        assert_eq!(
            redact(
                "https://x.webhook.office.com/webhookb2/3f2c1a9e-1b2c-4d5e-8f90-a1b2c3d4e5f6@72f988bf-86f1-41af-91ab-2d7cd011db47/IncomingWebhook/0a1b2c3d4e5f60718293a4b5c6d7e8f9/3f2c1a9e-1b2c-4d5e-8f90-a1b2c3d4e5f6"
            ),
            "https://x.webhook.office.com/webhookb2/***/IncomingWebhook/***/***"
        );
        assert_eq!(
            redact("https://api.example/v1/notifications-service/jobs/42"),
            "https://api.example/v1/notifications-service/jobs/42",
            "names and ids stay"
        );
        let text = "request to \"https://h/x?token=abc\" failed; fallback amqp://a:b@c/ also";
        assert_eq!(
            redact_text(text),
            "request to \"https://h/x?token=***\" failed; fallback amqp://a:***@c/ also"
        );
        assert_eq!(
            redact_text("\u{112a7}redis://u:p@h/0 and é·amqp://a:b@c"),
            "\u{112a7}redis://u:***@h/0 and é·amqp://a:***@c",
            "a scheme right after a character of several bytes"
        );
        assert_eq!(escape_control("ok"), "ok");
        assert_eq!(escape_control("a\nINFO forged\u{1b}[2J"), "a\\nINFO forged\\u{1b}[2J");
    }

    /// A secret as services issue them: 16 to 60 letters and digits of mixed case, maybe
    /// with `-` and `_` (shorter path segments are not masked: see [`looks_secret`]).
    fn secret() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_-]{0,4}[a-z]{4}[A-Z]{4}[0-9]{4}[A-Za-z0-9]{4,40}[A-Za-z0-9_-]{0,8}"
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: crate::fuzz_cases(2_000),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Wherever a URL carries a secret (password, username-only token, path segment,
        /// query value, fragment), and whatever text surrounds it, the secret never comes out.
        #[test]
        fn no_generated_secret_survives_redaction(
            scheme in "(https?|amqps?|rediss?)",
            host in "[a-z]{1,10}(\\.[a-z]{2,5}){0,2}",
            port in proptest::option::of(1u16..),
            names in proptest::collection::vec("[a-z]{1,12}", 0..4),
            secret in secret(),
            place in 0u8..5,
            before in "[ -~]{0,20}",
            after in "[ \t][ -~]{0,20}",
        ) {
            let port = port.map(|p| format!(":{p}")).unwrap_or_default();
            let path: String = names.iter().map(|n| format!("/{n}")).collect();
            let url = match place {
                0 => format!("{scheme}://user:{secret}@{host}{port}{path}"),
                1 => format!("{scheme}://{secret}@{host}{port}{path}"),
                2 => format!("{scheme}://{host}{port}{path}/{secret}/tail"),
                3 => format!("{scheme}://{host}{port}{path}?a=1&key={secret}"),
                _ => format!("{scheme}://{host}{port}{path}#{secret}"),
            };
            let text = format!("{before} {url}{after}");
            let shown = redact_text(&text);
            prop_assert!(!shown.contains(&secret), "{text:?} -> {shown:?}");
            prop_assert!(shown.contains(&host), "the host stays: {shown:?}");
        }

        /// Any text at all, URLs or not, any characters around `://`: redaction never panics
        /// and keeps the text outside the URLs.
        #[test]
        fn any_text_redacts(
            before in "\\PC{0,12}",
            scheme in "\\PC{0,6}",
            after in "\\PC{0,24}",
        ) {
            let text = format!("{before}{scheme}://{after}");
            let shown = redact_text(&text);
            prop_assert!(shown.contains("://"), "{text:?} -> {shown:?}");
            let _ = redact_text(&after);
        }
    }
}
