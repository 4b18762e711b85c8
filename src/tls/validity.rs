//! A certificate's validity window (`notBefore`, `notAfter`), read from its DER: the few
//! fields of the TBSCertificate before it are stepped over, nothing else is parsed. Every
//! length is checked against what is there and every read is bounded: hostile input gives
//! `None`, never a panic. Times are seconds since the Unix epoch (UTC), and back to a date
//! for messages.

/// When a certificate starts and stops being valid, in seconds since the Unix epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Validity {
    pub(crate) not_before: i64,
    pub(crate) not_after: i64,
}

/// One DER element: its tag, its contents and what follows it.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        // Long form: 1 to 4 length bytes (indefinite lengths are not DER).
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let (bytes, after) = (rest.get(..n)?, rest.get(n..)?);
        rest = after;
        bytes
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
    };
    Some((tag, rest.get(..len)?, rest.get(len..)?))
}

/// The contents of an element that must have tag `want`, and what follows it.
fn expect(input: &[u8], want: u8) -> Option<(&[u8], &[u8])> {
    let (tag, body, rest) = element(input)?;
    (tag == want).then_some((body, rest))
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const EXPLICIT_0: u8 = 0xa0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// The validity of a DER certificate, or `None` when it is not one this reader can follow.
pub(crate) fn validity(der: &[u8]) -> Option<Validity> {
    let (cert, _) = expect(der, SEQUENCE)?;
    let (tbs, _) = expect(cert, SEQUENCE)?;
    // version [0] EXPLICIT, absent for v1.
    let tbs = match element(tbs)? {
        (EXPLICIT_0, _, rest) => rest,
        _ => tbs,
    };
    let (_serial, tbs) = expect(tbs, INTEGER)?;
    let (_signature, tbs) = expect(tbs, SEQUENCE)?;
    let (_issuer, tbs) = expect(tbs, SEQUENCE)?;
    let (window, _) = expect(tbs, SEQUENCE)?;
    let (tag, before, rest) = element(window)?;
    let not_before = time(tag, before)?;
    let (tag, after, _) = element(rest)?;
    let not_after = time(tag, after)?;
    Some(Validity {
        not_before,
        not_after,
    })
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950–2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`), the
/// forms RFC 5280 allows, as seconds since the epoch.
fn time(tag: u8, text: &[u8]) -> Option<i64> {
    let (year, rest) = match (tag, text.len()) {
        (UTC_TIME, 13) => {
            let yy = digits(text.get(..2)?)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (GENERALIZED_TIME, 15) => (digits(text.get(..4)?)?, &text[4..]),
        _ => return None,
    };
    if rest.get(10) != Some(&b'Z') {
        return None;
    }
    let field = |at: usize| digits(rest.get(at..at + 2)?);
    let (month, day) = (field(0)?, field(2)?);
    let (hour, minute, second) = (field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month)
        || day == 0
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// ASCII digits as a number (at most four of them here).
fn digits(text: &[u8]) -> Option<i64> {
    text.iter().try_fold(0i64, |acc, &b| {
        b.is_ascii_digit().then(|| acc * 10 + i64::from(b - b'0'))
    })
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM-DD HH:MM:SS UTC` for a time in seconds since the epoch.
pub(crate) fn date(unix: i64) -> String {
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let (year, month, day) = crate::liveness::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER element with a definite length (short or long form).
    fn tlv(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        if body.len() < 0x80 {
            out.push(body.len() as u8);
        } else {
            out.extend([0x82, (body.len() >> 8) as u8, body.len() as u8]);
        }
        out.extend_from_slice(body);
        out
    }

    fn cert(version: bool, before: &[u8], after: &[u8]) -> Vec<u8> {
        let mut tbs = Vec::new();
        if version {
            tbs.extend(tlv(EXPLICIT_0, &tlv(INTEGER, &[2])));
        }
        tbs.extend(tlv(INTEGER, &[1, 2, 3]));
        tbs.extend(tlv(SEQUENCE, &tlv(0x06, &[42, 134, 72])));
        tbs.extend(tlv(SEQUENCE, &[0x55; 200])); // a long issuer: long-form length
        tbs.extend(tlv(SEQUENCE, &[before, after].concat()));
        tbs.extend(tlv(SEQUENCE, b"subject and the rest"));
        tlv(
            SEQUENCE,
            &[tlv(SEQUENCE, &tbs), tlv(SEQUENCE, b"sig")].concat(),
        )
    }

    #[test]
    fn both_time_forms_and_a_v1_certificate() {
        let c = cert(
            true,
            &tlv(UTC_TIME, b"200101000000Z"),
            &tlv(GENERALIZED_TIME, b"20600229235959Z"),
        );
        let v = validity(&c).expect("validity");
        assert_eq!(v.not_before, 1_577_836_800);
        assert_eq!(date(v.not_before), "2020-01-01 00:00:00 UTC");
        assert_eq!(date(v.not_after), "2060-02-29 23:59:59 UTC");
        let c = cert(
            false,
            &tlv(UTC_TIME, b"991231235959Z"),
            &tlv(UTC_TIME, b"490101000000Z"),
        );
        let v = validity(&c).expect("v1");
        assert_eq!(date(v.not_before), "1999-12-31 23:59:59 UTC");
        assert_eq!(date(v.not_after), "2049-01-01 00:00:00 UTC");
        assert_eq!(date(0), "1970-01-01 00:00:00 UTC");
    }

    #[test]
    fn malformed_times_are_refused() {
        for (tag, text) in [
            (UTC_TIME, &b"200101000000"[..]),
            (UTC_TIME, b"2001010000000"),
            (UTC_TIME, b"201301000000Z"),
            (UTC_TIME, b"210229000000Z"),
            (UTC_TIME, b"200100000000Z"),
            (UTC_TIME, b"200101240000Z"),
            (UTC_TIME, b"2001010000+0Z"),
            (GENERALIZED_TIME, b"200101000000Z"),
            (0x04, b"200101000000Z"),
        ] {
            let c = cert(true, &tlv(tag, text), &tlv(UTC_TIME, b"300101000000Z"));
            assert_eq!(validity(&c), None, "{:?}", String::from_utf8_lossy(text));
        }
    }

    /// Every truncation and every single-byte change of a good certificate: no panic.
    #[test]
    fn hostile_input_never_panics() {
        let good = cert(
            true,
            &tlv(UTC_TIME, b"200101000000Z"),
            &tlv(UTC_TIME, b"300101000000Z"),
        );
        assert!(validity(&good).is_some());
        for n in 0..good.len() {
            assert_eq!(validity(&good[..n]), None, "cut at {n}");
        }
        for at in 0..good.len() {
            for b in [0x00, 0x7f, 0x80, 0x81, 0x84, 0x85, 0xff] {
                let mut bad = good.clone();
                bad[at] = b;
                let _ = validity(&bad);
            }
        }
        assert_eq!(validity(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(validity(&[0x30, 0x80, 0, 0]), None);
    }
}
