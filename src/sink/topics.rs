//! Owns the sink producer's topic handles, and the send of a record through one.
//!
//! rdkafka's `send` names the topic of every record: it copies the name into a fresh CString
//! (allocate, scan for NUL, free), and librdkafka looks the topic up by name under a lock and takes
//! and drops a reference to it. At 100 B that was ~4 % of the bridge's instructions per record
//! (bench/results/20261205-profile-eos-100b-1s-callgrind-s30.txt: CString::new, memchr,
//! rd_kafka_topic_new0, rd_kafka_topic_find_fl, their malloc and free). A handle made once per
//! topic, and the topic of the record before, make the per-record cost one short comparison.
//!
//! A record with headers still goes through rdkafka's `send`: the pointer to its headers is
//! private to rdkafka. The bridge's records carry headers only when their source record did.

use std::collections::HashMap;
use std::ffi::CString;
use std::ptr::{self, NonNull};

use rdkafka::bindings as rd;
use rdkafka::bindings::rd_kafka_vtype_t::*;
use rdkafka::error::KafkaError;
use rdkafka::message::ToBytes;
use rdkafka::producer::BaseRecord;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::IntoOpaque;

use super::{Origin, Refused};

/// One topic handle of a producer.
struct Handle(NonNull<rd::rd_kafka_topic_t>);

// SAFETY: librdkafka's topic handles may be used, and destroyed, from any thread.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by rd_kafka_topic_new and destroyed once, here, while its producer lives
        // (see `TopicHandles`).
        unsafe { rd::rd_kafka_topic_destroy(self.0.as_ptr()) }
    }
}

/// The handles of one producer, one per topic it was given a record for. They must go before the
/// producer does: `Sink` declares its handles before its producer (fields drop in that order) and
/// clears them before it replaces the producer.
#[derive(Default)]
pub(super) struct TopicHandles {
    handles: Vec<(Box<str>, Handle)>,
    index: HashMap<Box<str>, usize>,
    /// The topic of the last record: nearly every record goes where the one before it went.
    last: usize,
}

impl TopicHandles {
    /// The handle of `topic` for the producer `rk`, made on first use.
    fn handle(
        &mut self,
        rk: *mut rd::rd_kafka_t,
        topic: &str,
    ) -> Result<*mut rd::rd_kafka_topic_t, KafkaError> {
        if let Some((name, h)) = self.handles.get(self.last) {
            if **name == *topic {
                return Ok(h.0.as_ptr());
            }
        }
        let i = match self.index.get(topic) {
            Some(&i) => i,
            None => {
                let name = CString::new(topic)?;
                // SAFETY: rk is a live producer (the caller's), name a NUL-terminated string that
                // librdkafka copies; a null conf takes the producer's default topic settings, as
                // a send by name does.
                let raw = unsafe { rd::rd_kafka_topic_new(rk, name.as_ptr(), ptr::null_mut()) };
                let Some(h) = NonNull::new(raw) else {
                    // SAFETY: reads this thread's last librdkafka error, set by the call above.
                    let code = RDKafkaErrorCode::from(unsafe { rd::rd_kafka_last_error() });
                    return Err(KafkaError::MessageProduction(code));
                };
                self.handles.push((topic.into(), Handle(h)));
                self.index.insert(topic.into(), self.handles.len() - 1);
                self.handles.len() - 1
            }
        };
        self.last = i;
        Ok(self.handles[i].1 .0.as_ptr())
    }

    /// Destroys every handle: before the producer they belong to is dropped.
    pub(super) fn clear(&mut self) {
        self.handles.clear();
        self.index.clear();
        self.last = 0;
    }

    /// Hands a record without headers to the producer `rk` through its topic's handle, with the
    /// same settings rdkafka's `send` uses (the bytes copied, the origin as the opaque that its
    /// delivery report hands back); a refused record comes back with the reason.
    #[allow(clippy::result_large_err)] // as rdkafka's send: the record comes back by value
    pub(super) fn send<'r, K, P>(
        &mut self,
        rk: *mut rd::rd_kafka_t,
        mut record: BaseRecord<'r, K, P, Origin>,
    ) -> Result<(), Refused<'r, K, P>>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        debug_assert!(record.headers.is_none(), "records with headers go by name");
        let rkt = match self.handle(rk, record.topic) {
            Ok(rkt) => rkt,
            Err(e) => return Err((e, record)),
        };
        let (payload, payload_len) = raw(record.payload);
        let (key, key_len) = raw(record.key);
        let opaque = record.delivery_opaque.into_ptr();
        // SAFETY: rk is a live producer and rkt its handle; librdkafka copies key and payload
        // (RD_KAFKA_MSG_F_COPY) before it returns, and owns the opaque unless it refuses.
        let err = unsafe {
            rd::rd_kafka_producev(
                rk,
                RD_KAFKA_VTYPE_RKT,
                rkt,
                RD_KAFKA_VTYPE_PARTITION,
                record.partition.unwrap_or(-1),
                RD_KAFKA_VTYPE_MSGFLAGS,
                rd::RD_KAFKA_MSG_F_COPY,
                RD_KAFKA_VTYPE_VALUE,
                payload,
                payload_len,
                RD_KAFKA_VTYPE_KEY,
                key,
                key_len,
                RD_KAFKA_VTYPE_OPAQUE,
                opaque,
                RD_KAFKA_VTYPE_TIMESTAMP,
                record.timestamp.unwrap_or(0),
                RD_KAFKA_VTYPE_END,
            )
        };
        if err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Ok(());
        }
        // SAFETY: refused, so librdkafka gave up the opaque made above: taken back once.
        record.delivery_opaque = unsafe { Origin::from_ptr(opaque) };
        Err((KafkaError::MessageProduction(err.into()), record))
    }
}

fn raw(bytes: Option<&(impl ToBytes + ?Sized)>) -> (*mut std::ffi::c_void, usize) {
    match bytes.map(ToBytes::to_bytes) {
        Some(b) => (b.as_ptr().cast_mut().cast(), b.len()),
        None => (ptr::null_mut(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::config::ClientConfig;
    use rdkafka::producer::{BaseProducer, Producer};

    /// No broker is needed: a producer makes topic handles without one.
    fn producer(settings: &[(&str, &str)]) -> BaseProducer {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", "127.0.0.1:1");
        for (k, v) in settings {
            cc.set(*k, *v);
        }
        cc.create().expect("a producer")
    }

    #[test]
    fn one_handle_per_topic_and_the_last_one_reused() {
        let p = producer(&[]);
        let rk = p.client().native_ptr();
        let mut t = TopicHandles::default();
        let a = t.handle(rk, "out-a").unwrap();
        let b = t.handle(rk, "out-b").unwrap();
        assert_ne!(a, b);
        assert_eq!(t.handle(rk, "out-a").unwrap(), a, "found by name");
        assert_eq!(t.handle(rk, "out-a").unwrap(), a, "the last topic's");
        assert_eq!(t.handle(rk, "out-b").unwrap(), b);
        assert_eq!(t.handles.len(), 2);
        // SAFETY: a live handle of a live producer.
        let name = unsafe { std::ffi::CStr::from_ptr(rd::rd_kafka_topic_name(a)) };
        assert_eq!(name.to_str().unwrap(), "out-a");
        t.clear();
        assert!(t.handles.is_empty() && t.index.is_empty());
    }

    #[test]
    fn a_topic_name_with_a_nul_is_refused_with_the_record() {
        let p = producer(&[]);
        let mut t = TopicHandles::default();
        let record: BaseRecord<'_, [u8], [u8], Origin> =
            BaseRecord::with_opaque_to("bad\0topic", Origin::packed(3, 42).unwrap())
                .payload(&b"x"[..]);
        let (err, back) = t.send(p.client().native_ptr(), record).unwrap_err();
        assert!(matches!(err, KafkaError::Nul(_)), "{err:?}");
        assert!(matches!(
            back.delivery_opaque,
            Origin::Packed {
                slot: 3,
                offset: 42
            }
        ));
        assert!(t.handles.is_empty());
    }

    #[test]
    fn a_send_librdkafka_refuses_comes_back_with_its_origin() {
        let p = producer(&[("queue.buffering.max.messages", "1")]);
        let rk = p.client().native_ptr();
        let mut t = TopicHandles::default();
        let record = |offset| -> BaseRecord<'static, [u8], [u8], Origin> {
            BaseRecord::with_opaque_to("out", Origin::packed(1, offset).unwrap())
                .partition(0)
                .payload(&b"x"[..])
        };
        assert!(t.send(rk, record(7)).is_ok());
        let (err, back) = t.send(rk, record(8)).unwrap_err();
        assert_eq!(
            err,
            KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull)
        );
        assert!(matches!(
            back.delivery_opaque,
            Origin::Packed { slot: 1, offset: 8 }
        ));
    }
}
