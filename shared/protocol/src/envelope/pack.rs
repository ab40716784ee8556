//! Packed messages: several jobs in one AMQP message.
//!
//! A pack's body is `{"v":1,"pack":[<envelope>,…]}`, each element a whole [`Envelope`] with
//! its own key, id, payload, attempts and options; its AMQP properties carry the header
//! [`PACK_HEADER`] (the number of jobs), `type` [`PACK_TYPE`] and a `message_id` of its own.
//! Every job of a pack goes to the same route. A worker unpacks it and settles each job on its
//! own: a job that must retry, park or be dead-lettered is published again *individually*, and
//! the pack is acked once every job in it is settled (requeued whole if any job could not be
//! decided; its done jobs are then absorbed by their keys).
//!
//! A worker parks runs in packs too (copies parked together for the same whole-second delay
//! to the same queue): each member then carries headers of its own (its rate-limit ticket,
//! its park count) in the body's `headers` array, one object of strings per member, which
//! the worker lays over the pack's headers when it unpacks.
//!
//! A worker older than packs reads a pack as a malformed envelope and dead-letters it: upgrade
//! the workers before producers pack (or before a worker parks in packs).

use super::{Envelope, VERSION};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::BTreeMap;

/// AMQP header marking a pack; its value is the number of jobs in it.
pub const PACK_HEADER: &str = "x-chime-pack";

/// The AMQP `type` of a pack (a job's message has its job's name there).
pub const PACK_TYPE: &str = "chime.pack";

/// Most jobs one pack may carry.
pub const MAX_PACK: usize = 1000;

/// Bytes a pack adds around its jobs: `{"v":1,"pack":[` and `]}`.
pub const OVERHEAD: usize = 18;

/// The body of a pack of `members` (each an encoded envelope, as [`Envelope::encode`] makes).
pub fn encode<B: AsRef<[u8]>>(members: &[B]) -> Vec<u8> {
    let len: usize = members.iter().map(|m| m.as_ref().len() + 1).sum();
    let mut body = Vec::with_capacity(len + OVERHEAD);
    body.extend_from_slice(format!("{{\"v\":{VERSION},\"pack\":[").as_bytes());
    for (i, m) in members.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(m.as_ref());
    }
    body.extend_from_slice(b"]}");
    body
}

/// The body of a pack of `members` with each member's own headers (`headers[i]` for
/// `members[i]`, the same length): `{"v":1,"pack":[…],"headers":[{…},…]}`.
pub fn encode_with_headers<B: AsRef<[u8]>, H: std::borrow::Borrow<MemberHeaders>>(
    members: &[B],
    headers: &[H],
) -> Vec<u8> {
    let headers: Vec<&MemberHeaders> = headers.iter().map(std::borrow::Borrow::borrow).collect();
    let mut body = encode(members);
    body.truncate(body.len() - 1);
    body.extend_from_slice(b",\"headers\":");
    // A map of strings always serializes.
    body.extend_from_slice(&serde_json::to_vec(&headers).unwrap_or_else(|_| b"[]".to_vec()));
    body.push(b'}');
    body
}

/// A member's own headers in a pack (string values, as [`super::put_header`] writes them).
pub type MemberHeaders = BTreeMap<String, String>;

/// The AMQP properties of a pack of `jobs` jobs: persistent JSON, `type` [`PACK_TYPE`], its
/// own `message_id`, the header [`PACK_HEADER`], and the first job's `timestamp`.
pub fn properties(first: &Envelope, jobs: usize) -> BasicProperties {
    properties_at(u64::try_from(first.enqueued_at.timestamp()).unwrap_or(0), jobs)
}

/// [`properties`] with the `timestamp` given.
pub fn properties_at(ts: u64, jobs: usize) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from(PACK_HEADER), AMQPValue::LongLongInt(jobs as i64));
    BasicProperties::default()
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
        .with_message_id(ShortString::from(super::new_id().to_string()))
        .with_type(ShortString::from(PACK_TYPE))
        .with_timestamp(ts)
        .with_headers(headers)
}

/// One message of [`messages`]: a pack, or a lone envelope as itself.
#[derive(Debug, Clone)]
pub struct Message {
    /// The body (a pack's, or the envelope's own).
    pub body: Vec<u8>,
    /// Its properties.
    pub props: BasicProperties,
    /// The route of its jobs ([`Envelope::route`]).
    pub route: String,
    /// How many jobs it carries.
    pub jobs: usize,
}

/// `envs` as messages, in order: consecutive envelopes for the same route packed up to `n`
/// per message and `max_bytes` per body; an envelope alone in its group (and a broadcast
/// copy, which is never packed) stays a message of its own.
pub fn messages(envs: &[Envelope], n: usize, max_bytes: usize) -> Vec<Message> {
    let mut out = Vec::new();
    let mut group: Vec<(&Envelope, Vec<u8>)> = Vec::new();
    let mut size = OVERHEAD;
    let close = |out: &mut Vec<Message>, group: &mut Vec<(&Envelope, Vec<u8>)>| match group.len() {
        0 => {}
        1 => {
            let (env, body) = group.remove(0);
            out.push(Message { body, props: env.properties(), route: env.route(), jobs: 1 });
        }
        jobs => {
            let bodies: Vec<&[u8]> = group.iter().map(|(_, b)| b.as_slice()).collect();
            let (first, _) = group[0];
            out.push(Message {
                body: encode(&bodies),
                props: properties(first, jobs),
                route: first.route(),
                jobs,
            });
            group.clear();
        }
    };
    for env in envs {
        let body = env.encode();
        let joins = group.first().is_some_and(|(first, _)| {
            env.target.is_none()
                && first.target.is_none()
                && first.route() == env.route()
                && group.len() < n
                && size + body.len() < max_bytes
        });
        if !joins {
            close(&mut out, &mut group);
            size = OVERHEAD;
        }
        size += body.len() + 1;
        group.push((env, body));
    }
    close(&mut out, &mut group);
    out
}

/// Whether a message with these properties is a pack.
pub fn is_pack(props: &BasicProperties) -> bool {
    props.headers().as_ref().is_some_and(|h| h.inner().contains_key(PACK_HEADER))
}

#[derive(Deserialize)]
struct Body<'a> {
    v: u32,
    #[serde(borrow)]
    pack: Vec<&'a RawValue>,
    #[serde(default)]
    headers: Option<Vec<MemberHeaders>>,
}

/// Why a body marked as a pack is not one (the message is dead-lettered whole, as
/// `malformed`).
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// Not `{"v":1,"pack":[…]}`.
    #[error("body is not a chime pack: {}", crate::escape_control(&.0.to_string()))]
    Json(#[from] serde_json::Error),
    /// `v` is not the version this release reads.
    #[error("unsupported pack version {0} (this release reads v{VERSION})")]
    Version(u32),
    /// No jobs, or more than [`MAX_PACK`].
    #[error("a pack holds 1 to {MAX_PACK} jobs, this one {0}")]
    Size(usize),
    /// `headers` is not one object per job, or names a header AMQP cannot carry.
    #[error(
        "a pack's headers must be one object per job ({jobs} jobs), with names of 1 to 255 bytes: {found}"
    )]
    Headers {
        /// Jobs in the pack.
        jobs: usize,
        /// What was found instead.
        found: String,
    },
}

/// The jobs of a pack body, each as the bytes of its envelope (decoded one by one with
/// [`Envelope::decode`]: a malformed job is dead-lettered alone).
pub fn split(body: &[u8]) -> Result<Vec<&[u8]>, PackError> {
    unpack(body).map(|(jobs, _)| jobs)
}

/// [`split`], with each job's own headers (empty when the pack carries none, else one map
/// per job).
pub fn unpack(body: &[u8]) -> Result<(Vec<&[u8]>, Vec<MemberHeaders>), PackError> {
    let body: Body<'_> = serde_json::from_slice(body)?;
    if body.v != VERSION {
        return Err(PackError::Version(body.v));
    }
    let jobs = body.pack.len();
    if jobs == 0 || jobs > MAX_PACK {
        return Err(PackError::Size(jobs));
    }
    let headers = body.headers.unwrap_or_default();
    let found = if !headers.is_empty() && headers.len() != jobs {
        Some(format!("{} objects", headers.len()))
    } else {
        headers
            .iter()
            .flat_map(BTreeMap::keys)
            .find(|k| k.is_empty() || k.len() > 255)
            .map(|k| format!("a header name of {} bytes", k.len()))
    };
    if let Some(found) = found {
        return Err(PackError::Headers { jobs, found });
    }
    Ok((body.pack.into_iter().map(|m| m.get().as_bytes()).collect(), headers))
}

/// The pack's properties with a member's own headers laid over its headers (the pack marker
/// kept: [`member_properties`] drops it).
pub fn with_member_headers(pack: &BasicProperties, own: &MemberHeaders) -> BasicProperties {
    if own.is_empty() {
        return pack.clone();
    }
    let mut headers = pack.headers().clone().unwrap_or_default();
    for (k, v) in own {
        super::put_header(&mut headers, k, v);
    }
    pack.clone().with_headers(headers)
}

/// The properties a job of a pack is handled (and dead-lettered, and retried) with: its own
/// (`message_id` its key, `type` its job), with the pack's headers but the pack marker.
pub fn member_properties(env: &Envelope, pack: &BasicProperties) -> BasicProperties {
    env.properties().with_headers(unmarked_headers(pack))
}

/// The pack's properties without the pack marker: those of a job of it that is not an
/// envelope (dead-lettered alone, as `malformed`).
pub fn unmarked(pack: &BasicProperties) -> BasicProperties {
    pack.clone().with_headers(unmarked_headers(pack))
}

fn unmarked_headers(pack: &BasicProperties) -> FieldTable {
    let mut headers = FieldTable::default();
    if let Some(h) = pack.headers() {
        for (k, v) in h.inner() {
            if k.as_str() != PACK_HEADER {
                headers.insert(k.clone(), v.clone());
            }
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Source, adhoc_key};

    fn job(i: u32) -> Envelope {
        Envelope::new(
            "j",
            "default",
            adhoc_key("j", &i.to_string()),
            serde_json::json!({"i": i, "s": "a]},{\"v\":2"}),
            None,
            3,
            Source::Adhoc,
        )
    }

    #[test]
    fn a_pack_splits_into_its_jobs_byte_for_byte() {
        let jobs: Vec<Envelope> = (0..5).map(job).collect();
        let encoded: Vec<Vec<u8>> = jobs.iter().map(Envelope::encode).collect();
        let body = encode(&encoded);
        let parts = split(&body).unwrap();
        assert_eq!(parts.len(), 5);
        for ((part, bytes), env) in parts.iter().zip(&encoded).zip(&jobs) {
            assert_eq!(*part, bytes.as_slice());
            assert_eq!(&Envelope::decode(part).unwrap(), env);
        }
        let props = properties(&jobs[0], 5);
        assert!(is_pack(&props));
        let member = member_properties(&jobs[2], &props);
        assert!(!is_pack(&member));
        assert_eq!(member.message_id().as_ref().unwrap().as_str(), jobs[2].key.to_string());
        assert!(!is_pack(&jobs[0].properties()));
    }

    #[test]
    fn messages_pack_consecutive_jobs_of_one_route_up_to_n_and_the_size() {
        let jobs: Vec<Envelope> = (0..25).map(job).collect();
        let out = messages(&jobs, 10, 1 << 20);
        assert_eq!(out.iter().map(|m| m.jobs).collect::<Vec<_>>(), [10, 10, 5]);
        assert!(out.iter().all(|m| is_pack(&m.props) && m.route == "default"));
        let back: Vec<Envelope> =
            out.iter().flat_map(|m| split(&m.body).unwrap()).map(|b| Envelope::decode(b).unwrap()).collect();
        assert_eq!(back, jobs, "every job once, in order");
        // A body that would pass max_bytes starts a new pack; a job alone is itself.
        let one = jobs[0].encode().len() + 1;
        let out = messages(&jobs[..5], 10, OVERHEAD + 2 * one);
        assert_eq!(out.iter().map(|m| m.jobs).collect::<Vec<_>>(), [2, 2, 1]);
        assert!(!is_pack(&out[2].props) && out[2].body == jobs[4].encode());
        // Another route cuts the pack.
        let mut mixed = jobs[..4].to_vec();
        mixed[2].queue = "other".into();
        let out = messages(&mixed, 10, 1 << 20);
        assert_eq!(
            out.iter().map(|m| (m.jobs, m.route.as_str())).collect::<Vec<_>>(),
            [(2, "default"), (1, "other"), (1, "default")]
        );
    }

    #[test]
    fn members_carry_their_own_headers_over_the_packs() {
        let jobs: Vec<Envelope> = (0..3).map(job).collect();
        let encoded: Vec<Vec<u8>> = jobs.iter().map(Envelope::encode).collect();
        let own: Vec<MemberHeaders> = (0..3)
            .map(|i| MemberHeaders::from([("x-chime-rate-at".to_string(), format!("{i}00"))]))
            .collect();
        let body = encode_with_headers(&encoded, &own);
        let (parts, headers) = unpack(&body).unwrap();
        assert_eq!(parts, encoded.iter().map(Vec::as_slice).collect::<Vec<_>>());
        assert_eq!(headers, own);
        assert_eq!(split(&body).unwrap(), parts, "split reads the same jobs");
        let mut props = properties(&jobs[0], 3);
        let mut pack_headers = props.headers().clone().unwrap_or_default();
        super::super::put_header(&mut pack_headers, "x-death-like", "pack");
        super::super::put_header(&mut pack_headers, "x-chime-rate-at", "stale");
        props = props.with_headers(pack_headers);
        let member = member_properties(&jobs[1], &with_member_headers(&props, &headers[1]));
        assert!(!is_pack(&member));
        assert_eq!(
            super::super::header_str(&member, "x-chime-rate-at").as_deref(),
            Some("100"),
            "its own wins"
        );
        assert_eq!(
            super::super::header_str(&member, "x-death-like").as_deref(),
            Some("pack"),
            "the pack's stay"
        );
        // A pack without headers unpacks with none.
        assert!(unpack(&encode(&encoded)).unwrap().1.is_empty());
    }

    #[test]
    fn bad_packs_are_refused_by_name() {
        let two = b"{\"v\":1,\"pack\":[{},{}],\"headers\":[{\"a\":\"1\"}]}";
        let e = unpack(two).unwrap_err().to_string();
        assert!(e.contains("one object per job (2 jobs)") && e.contains("1 objects"), "{e}");
        let long = format!("{{\"v\":1,\"pack\":[{{}}],\"headers\":[{{\"{}\":\"1\"}}]}}", "h".repeat(256));
        let e = unpack(long.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("a header name of 256 bytes"), "{e}");
        assert!(unpack(b"{\"v\":1,\"pack\":[{}],\"headers\":[{\"a\":1}]}").is_err(), "string values only");
        assert!(matches!(split(b"{\"v\":1,\"pack\":[]}"), Err(PackError::Size(0))));
        assert!(matches!(split(b"{\"v\":2,\"pack\":[{}]}"), Err(PackError::Version(2))));
        let e = split(b"{\"v\":1}").unwrap_err().to_string();
        assert!(e.contains("pack"), "{e}");
        assert!(split(&job(1).encode()).is_err(), "an envelope is not a pack");
        // A member that is not an envelope still splits: it is dead-lettered alone.
        let parts = split(b"{\"v\":1,\"pack\":[{\"x\":1},2]}").unwrap();
        assert_eq!(parts, vec![&b"{\"x\":1}"[..], &b"2"[..]]);
        assert!(Envelope::decode(parts[1]).is_err());
    }
}
