-- 0030_node_images: every node keeps a list of the guest images it has run, so that a snapshot
-- restores on the image it was taken from (docs/operations.md, "Rolling upgrades").
--
-- node_images: the guest images (kernel, initramfs, root file systems) a node was configured
-- with, by image hash, written at each start (node/images.c). A snapshot records its image's
-- hash (snapshots.image_hash); a node restores a snapshot of another image than its current one
-- only from the files this table names for it on that node, and refuses when it has none.
CREATE TABLE node_images (
    node_id         text NOT NULL,
    image_hash      text NOT NULL,
    kernel          text NOT NULL,
    initrd          text NOT NULL,
    rootfs          text NOT NULL,
    codeint_rootfs  text NOT NULL DEFAULT '',
    seen_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, image_hash)
);
