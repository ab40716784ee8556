//! The bodies of `POST /api/v1/jobs/{job}` and `POST /api/v1/jobs/{job}/batch`, read into
//! `EnqueueRequest`s; every error names its field.

use chime_producer::EnqueueRequest;
use chime_shared::config::Priority;

/// The fields of the body, as the OpenAPI document lists them (checked by a unit test).
#[cfg(test)]
pub const FIELDS: [&str; 6] = ["payload", "key", "delay", "at", "priority", "max_attempts"];

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, expecting = "an object such as {\"payload\": ..., \"key\": ...}")]
struct JobBody {
    #[serde(default)]
    payload: Option<serde_json::Value>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    delay: Option<Delay>,
    #[serde(default)]
    at: Option<String>,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default)]
    max_attempts: Option<u32>,
}

/// Seconds, or a duration as the config spells them (`"90s"`, `"5m"`).
#[derive(Debug)]
enum Delay {
    Seconds(u64),
    Text(String),
}

impl<'de> serde::Deserialize<'de> for Delay {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Delay;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration (\"30s\", \"5m\") or a whole number of seconds")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Delay, E> {
                Ok(Delay::Seconds(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Delay, E> {
                u64::try_from(v)
                    .map(Delay::Seconds)
                    .map_err(|_| E::custom(format!("{v}: a delay is not negative")))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Delay, E> {
                Err(E::custom(format!("{v}: a delay is a whole number of seconds")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Delay, E> {
                Ok(Delay::Text(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A bad body: the field at fault (`None`: the body as a whole), and what is wrong.
pub type BodyError = (Option<String>, String);

/// The fields of a batch's body (checked against the OpenAPI document by a unit test).
#[cfg(test)]
pub const BATCH_FIELDS: [&str; 2] = ["jobs", "pack"];

/// The body of `POST /api/v1/jobs/{job}/batch`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    jobs: Vec<JobBody>,
    #[serde(default)]
    pack: Option<usize>,
}

/// Reads `bytes` (empty: `{}`) as the body of an enqueue of `job`.
pub fn request(job: &str, bytes: &[u8]) -> Result<EnqueueRequest, BodyError> {
    let bytes = without_bom(bytes);
    let text = if bytes.iter().all(u8::is_ascii_whitespace) { &b"{}"[..] } else { bytes };
    let body: JobBody = object(text, "{\"payload\": ..., \"key\": ...}")?;
    into_request(job, body)
}

/// Reads `bytes` as a batch of enqueues of `job` (`{"jobs": [{...}, ...], "pack": N}`, each
/// element what [`request`] reads): the requests, in order, and the pack size asked for. A bad
/// element's field is named with its index (`jobs[2].priority`).
pub fn batch(job: &str, bytes: &[u8]) -> Result<(Vec<EnqueueRequest>, Option<usize>), BodyError> {
    let body: BatchBody = object(bytes, "{\"jobs\": [{\"payload\": ...}, ...]}")?;
    if body.jobs.is_empty() {
        return Err((Some("jobs".into()), "jobs is empty: a batch has at least one job".into()));
    }
    let reqs = body
        .jobs
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            into_request(job, b).map_err(|(field, message)| {
                let at = format!("jobs[{i}]");
                (Some(field.map_or(at.clone(), |f| format!("{at}.{f}"))), format!("{at}: {message}"))
            })
        })
        .collect::<Result<_, _>>()?;
    Ok((reqs, body.pack))
}

/// `text` read as one JSON object of type `T`; an error names the field at fault (an unknown
/// one by its name), `shape` shows what is expected.
fn object<T: serde::de::DeserializeOwned>(text: &[u8], shape: &str) -> Result<T, BodyError> {
    let text = without_bom(text);
    if text.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err((None, format!("bad body: a JSON object is expected ({shape})")));
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    let body: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = inner.to_string();
        if inner.is_syntax() || inner.is_eof() {
            return (None, format!("the body is not valid JSON: {message}"));
        }
        // The path names an unknown field too (`jobs[2].paylod`).
        let field = (path != ".").then_some(path);
        (field, format!("bad body: {message}"))
    })?;
    de.end().map_err(|e| (None, format!("the body is not valid JSON: {e}")))?;
    Ok(body)
}

/// `bytes` without a leading UTF-8 byte order mark, which JSON parsers may ignore (RFC 8259,
/// section 8.1) and some Windows tools write.
fn without_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes)
}

/// The enqueue of `job` a body asks for.
fn into_request(job: &str, body: JobBody) -> Result<EnqueueRequest, BodyError> {
    let mut req = EnqueueRequest::new(job);
    if let Some(p) = body.payload {
        req = req.payload(p);
    }
    if let Some(k) = body.key {
        req = req.key(k);
    }
    if let Some(n) = body.max_attempts {
        req = req.max_attempts(n);
    }
    if let Some(p) = body.priority {
        let level: Priority =
            p.parse().map_err(|e: String| (Some("priority".to_string()), format!("priority {e}")))?;
        req = req.priority(level);
    }
    if body.delay.is_some() && body.at.is_some() {
        return Err((Some("at".into()), "give delay or at, not both".into()));
    }
    match body.delay {
        Some(Delay::Seconds(s)) => req = req.delay(std::time::Duration::from_secs(s)),
        Some(Delay::Text(t)) => {
            let d = chime_shared::duration::parse(&t).map_err(|e| {
                (Some("delay".to_string()), format!("delay: {e}; or a whole number of seconds"))
            })?;
            req = req.delay(d);
        }
        None => {}
    }
    if let Some(at) = body.at {
        let t = chrono::DateTime::parse_from_rfc3339(&at)
            .map_err(|e| (Some("at".to_string()), format!("at {at:?}: not an RFC 3339 time: {e}")))?;
        req = req.at(t.with_timezone(&chrono::Utc));
    }
    Ok(req)
}
