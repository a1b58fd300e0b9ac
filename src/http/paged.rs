//! A JSON document whose list is read and sent a page at a time, so that a long history or
//! metrics read holds a page or two in memory, not its whole list.

use axum::body::{Body, Bytes};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt, TryStreamExt};

use super::error::ApiError;
use crate::store::StoreResult;

/// How a document is written around its list of pages' items.
pub(super) trait Document: Send + 'static {
    type Page: Send + 'static;
    /// The document up to its list.
    const HEAD: &'static [u8];
    /// A page's items, comma-separated (a page is never empty).
    fn items(&mut self, page: Self::Page) -> Vec<u8>;
    /// The document after its list, once every page is in.
    fn tail(&self) -> Vec<u8>;
}

/// The answer of a read of `pages`. The first two pages are read before the status, so that
/// a failed read is still an error status and a list within one page is one body with a
/// length; after them each page is read while the one before is written (a channel of one
/// page), and a read that fails part way ends the connection before the document's end.
pub(super) async fn paged<D: Document>(
    mut document: D,
    pages: impl Stream<Item = StoreResult<D::Page>> + Send + 'static,
) -> Result<Response, ApiError> {
    let mut pages = Box::pin(pages);
    let mut start = D::HEAD.to_vec();
    let first = pages.try_next().await?;
    let second = match first {
        Some(first) => {
            start.extend(document.items(first));
            pages.try_next().await?
        }
        None => None,
    };
    let Some(second) = second else {
        start.extend(document.tail());
        return Ok(json(start));
    };
    let (next, read) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut pages = futures_util::stream::iter([Ok(second)]).chain(pages);
        while let Some(page) = pages.next().await {
            let piece = page.map(|page| Bytes::from([b",".as_slice(), &document.items(page)].concat()));
            if let Err(e) = &piece {
                tracing::warn!(error = %e, "a paged read failed part way");
            }
            let failed = piece.is_err();
            // Gone: the client left (the body was dropped).
            if next.send(piece).await.is_err() || failed {
                return;
            }
        }
        let _ = next.send(Ok(Bytes::from(document.tail()))).await;
    });
    let rest = tokio_stream::wrappers::ReceiverStream::new(read);
    let body = futures_util::stream::iter([Ok(Bytes::from(start))]).chain(rest);
    Ok(([(CONTENT_TYPE, "application/json")], Body::from_stream(body)).into_response())
}

pub(super) fn json(body: Vec<u8>) -> Response {
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}
